"""The 8-bit search's small kernels, timed alone (CPU s, best of 5, one BLAS thread as the
search runs them):

    python bench/bench_eight_bit_kernels.py

- the triangular inverse of H's Cholesky factor (weight rounding), by halves against numpy's
  general inverse, at MiniLM's K (384, 1536);
- GPTQ's column loop (weight rounding) at MiniLM's FFN shapes, INT8 and FP8;
- the pooled rel L2 of a 4-sample trial (every ranking and rule trial) against OutputErrors'
  whole accumulation, at ppocr_det's 1x1x320x320 map and a 640x640 one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from threadpoolctl import threadpool_limits

from npuprep.numerics import eight_bit_format
from npuprep.rewrite.weight_rounding import _sequential, inverse_factor, upper_inverse
from npuprep.verify.output_errors import OutputErrors, worst_pooled_rel_l2


def best(f: Callable[[], object], repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.process_time()
        f()
        times.append(time.process_time() - start)
    return min(times)


def every_error(got: list[dict[str, np.ndarray]], expected: list[dict[str, np.ndarray]]) -> float:
    """The pooled rel L2 through OutputErrors.add (decisions, concentration and all)."""
    errors = OutputErrors()
    for g, r in zip(got, expected, strict=True):
        for name in r:
            errors.add(name, r[name], g[name])
    return max(o["rel_l2"] for o in errors.result().values())


def main() -> None:
    rng = np.random.default_rng(0)
    with threadpool_limits(1, user_api="blas"):
        for k in (384, 1536):
            x = rng.standard_normal((3 * k, k))
            v = np.linalg.cholesky((x.T @ x + np.eye(k))[None, ::-1, ::-1])[:, ::-1, ::-1]
            print(f"triangular inverse K={k}: general {best(lambda v=v: np.linalg.inv(v)):.3f} s, "
                  f"by halves {best(lambda v=v: upper_inverse(v)):.3f} s")
        for name in ("int8", "fp8_e4m3"):
            fmt = eight_bit_format(name)
            for k, o in ((1536, 384), (384, 1536)):
                x = rng.standard_normal((3 * k, k))
                u = inverse_factor((x.T @ x)[None])
                rows = rng.standard_normal((1, o, k)) * 0.05
                scale = np.abs(rows).max(axis=2) / fmt.qmax
                print(f"GPTQ columns {name} K={k} O={o}: "
                      f"{best(lambda r=rows, s=scale, f=fmt, u=u: _sequential(r, s, f, u)):.3f} s")
    for side in (320, 640):
        ref = [{"y": rng.random((1, 1, side, side), dtype=np.float32)} for _ in range(4)]
        got = [{"y": r["y"] + rng.standard_normal(r["y"].shape).astype(np.float32) * 0.01}
               for r in ref]
        assert every_error(got, ref) == worst_pooled_rel_l2(got, ref)
        print(f"pooled rel L2, 4 samples of {side}x{side}: OutputErrors "
              f"{best(lambda g=got, r=ref: every_error(g, r)) * 1e3:.1f} ms, the sums alone "
              f"{best(lambda g=got, r=ref: worst_pooled_rel_l2(g, r)) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
