"""Input samples: .npz files, directories of them, batched .npz, Polygraphy JSON, synthetic.

Samples stream one at a time so memory does not grow with their number; every sample is
checked against the model's inputs (names, dtypes, fixed dimensions, finiteness).
"""

from __future__ import annotations

import math
import os
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx

from npuprep.errors import NpuprepError
from npuprep.ops import PASSTHROUGH_OPS
from npuprep.resources import budget as memory_budget
from npuprep.sample_size import sample_size

Feed = dict[str, np.ndarray]
# What names a sample in a stats file: its file name (directories), else its index.
SampleId = str | int


@dataclass(frozen=True)
class InputSpec:
    """A graph input: name, numpy dtype and shape (None for a symbolic dimension)."""

    name: str
    dtype: np.dtype
    shape: tuple[int | None, ...]
    # Synthetic values: floats in [low, high), integers low..high; None: normal floats, integers 0..3.
    low: float | None = None
    high: float | None = None
    # An attention-mask-like input: synthetic values are 0/1 with at least one 1 per row.
    mask: bool = False


def input_specs(model: onnx.ModelProto) -> list[InputSpec]:
    """The inputs a caller must feed (graph inputs that are not initialisers)."""
    inits = {i.name for i in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        kind = vi.type.WhichOneof("value")
        if kind != "tensor_type":
            raise NpuprepError(f"graph input '{vi.name}' is a {(kind or 'untyped').replace('_type', '')} "
                               "value, not a tensor: npuprep can only feed tensor inputs")
        tt = vi.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        dims = tuple(
            d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
            for d in tt.shape.dim
        )
        specs.append(InputSpec(vi.name, np.dtype(dtype), dims))
    return specs


@dataclass(frozen=True)
class SampleSet:
    """A re-iterable source of feeds with a description for reports.

    `start` is the index of its first sample in the whole source (a shard's offset, see
    `shard`): it names the samples of indexed sources. A directory's samples are named by
    their file names (and its shards hold only their own files).
    """

    source: str
    kind: str  # npz | dir | batched | polygraphy | synthetic
    specs: tuple[InputSpec, ...]
    files: tuple[str, ...] = ()
    count: int = 0
    seed: int = 0
    start: int = 0

    @property
    def synthetic(self) -> bool:
        return self.kind == "synthetic"

    def describe(self) -> str:
        return describe_samples(self.kind, self.source, self.count, self.seed)

    def source_info(self) -> dict[str, str | int]:
        """Where the samples come from, as a stats file records it (see describe_samples)."""
        info: dict[str, str | int] = {"kind": self.kind, "source": self.source}
        return info | {"seed": self.seed} if self.synthetic else info

    def sample_ids(self) -> tuple[SampleId, ...]:
        """The name of each sample, in order: file names for .npz files, else indices into
        the whole source. Sorting the names of any shards gives the whole source's order."""
        if self.kind in ("npz", "dir"):
            return tuple(Path(f).name for f in self.files)
        return tuple(range(self.start, self.start + self.count))

    def shard(self, k: int, n: int) -> SampleSet:
        """The k-th (1-based) of n contiguous slices, as equal as can be: sorted file names
        for a directory, indices otherwise; the same on every machine."""
        if not 1 <= k <= n:
            raise NpuprepError(f"shard {k}/{n}: expected 1 <= K <= N")
        if n > self.count:
            raise NpuprepError(f"shard {k}/{n}: {self.source} holds only {self.count} samples, "
                               f"so at most {self.count} shards")
        a, b = (self.count * (k - 1)) // n, (self.count * k) // n
        if self.kind in ("npz", "dir"):
            return replace(self, files=self.files[a:b], count=b - a)
        return replace(self, count=b - a, start=self.start + a)

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Feed]:
        return self.iter_range(0, self.count)

    def iter_range(self, start: int, stop: int) -> Iterator[Feed]:
        """Samples start..stop-1 (of this set, which may be a shard), validated, one at a time."""
        if self.kind == "synthetic":
            for i in range(self.start + start, self.start + stop):
                yield _synthetic_feed(self.specs, self.seed, i)
        elif self.kind == "npz" or self.kind == "dir":
            for f in self.files[start:stop]:
                yield _validate(_read_npz(Path(f)), self.specs, f)
        elif self.kind == "batched":
            arrays = _read_npz(Path(self.files[0]))
            ranks = {s.name: len(s.shape) for s in self.specs}
            for i in range(self.start + start, self.start + stop):
                # An array of the input's own rank is split keeping axis 0 (a batch of 1 per
                # sample, for models with a batch dimension); one rank higher, by indexing.
                feed = {k: v[i : i + 1] if v.ndim == ranks.get(k) else v[i] for k, v in arrays.items()}
                yield _validate(feed, self.specs, f"{self.files[0]}[{i}]")
        elif self.kind == "polygraphy":
            from polygraphy.json import load_json

            feeds = load_json(self.files[0])
            for i in range(self.start + start, self.start + stop):
                yield _validate(dict(feeds[i]), self.specs, f"{self.files[0]}[{i}]")


def describe_samples(kind: str, source: str, count: int, seed: int = 0) -> str:
    """The one-line description of `count` samples from `source` that reports show."""
    if kind == "synthetic":
        return f"{count} synthetic samples (seed {seed}); not real data"
    return f"{count} samples from {source} ({kind})"


class FeedStream:
    """Feeds from any iterable (a generator over a data loader), read once, in order, one at
    a time, each validated against the model's inputs like a file's. `count` is None when
    the iterable has no length; then it is known once the iterable is exhausted."""

    kind = "stream"
    synthetic = False
    source = "a Python iterable"

    def __init__(self, feeds: Iterable[Feed], model: onnx.ModelProto) -> None:
        try:
            self.count: int | None = len(feeds)  # type: ignore[arg-type]
        except TypeError:
            self.count = None
        self.specs = tuple(input_specs(model))
        self._feeds = iter(feeds)
        self.read = 0  # samples taken so far

    def iter_range(self, start: int, stop: int | None) -> Iterator[Feed]:
        """The next samples, start..stop-1 (to the end with None): a stream reads forward only."""
        if start != self.read:
            raise NpuprepError(f"sample stream: sample {start} asked for after {self.read} were read "
                               "(a stream is read once, in order)")
        while stop is None or self.read < stop:
            feed = next(self._feeds, None)
            if feed is None:
                break
            if not isinstance(feed, dict):
                raise NpuprepError(f"sample stream: sample {self.read} is a {type(feed).__name__}, "
                                   "not a dict of input name -> array")
            self.read += 1
            yield _validate(feed, self.specs, f"sample {self.read - 1} of the stream")

    def describe(self) -> str:
        return describe_samples(self.kind, self.source, self.read)

    def source_info(self) -> dict[str, str | int]:
        return {"kind": self.kind, "source": self.source}

    def sample_ids(self) -> tuple[SampleId, ...]:
        return tuple(range(self.read))


def load_samples(
    spec: str | Path, model: onnx.ModelProto, *, batched: bool = False
) -> SampleSet:
    """Open a sample source and check the first sample against the model's inputs."""
    specs = tuple(input_specs(model))
    path = Path(spec)
    if not path.exists():
        raise NpuprepError(f"{path}: data not found")
    if not (path.is_dir() or path.is_file()):
        # A FIFO or device would block the read (or never end): refuse it.
        raise NpuprepError(f"{path}: not a regular file or folder")
    if path.is_dir():
        files = tuple(str(p) for p in sorted(path.glob("*.npz")) if p.is_file())
        if not files:
            raise NpuprepError(f"{path}: directory holds no .npz samples")
        samples = SampleSet(str(path), "dir", specs, files, len(files))
    elif path.suffix == ".json":
        count = _polygraphy_count(path)
        samples = SampleSet(str(path), "polygraphy", specs, (str(path),), count)
    elif path.suffix == ".npz":
        if batched:
            arrays = _read_npz(path)
            counts = {k: (v.shape[0] if v.ndim else 0) for k, v in arrays.items()}
            if len(set(counts.values())) != 1 or 0 in counts.values():
                raise NpuprepError(
                    f"{path}: --batched needs every array to share axis 0 (got {counts})"
                )
            samples = SampleSet(str(path), "batched", specs, (str(path),), next(iter(counts.values())))
        else:
            samples = SampleSet(str(path), "npz", specs, (str(path),), 1)
    else:
        raise NpuprepError(f"{path}: unknown data format (use .npz, a directory of .npz, or Polygraphy .json)")
    # Fail early on the first sample rather than deep inside a long run.
    next(samples.iter_range(0, 1))
    return samples


def synthetic_samples(model: onnx.ModelProto, count: int, seed: int = 0, *,
                      ranges: Mapping[str, tuple[float, float]] | None = None,
                      shapes: Mapping[str, tuple[int, ...]] | None = None) -> SampleSet:
    """Seeded random samples shaped like the model's inputs (symbolic dims become 1).

    `ranges` {input: (lo, hi)} draws that input uniformly from [lo, hi) (integers: lo..hi);
    `shapes` {input: dims} fixes its shape. An integer input that indexes a constant table
    (an embedding `Gather`) stays within the table unless a range says otherwise.
    """
    if count < 1:
        raise NpuprepError(f"--synthetic needs a positive count, got {count}")
    specs = {s.name: s for s in input_specs(model)}
    for name in [*(ranges or {}), *(shapes or {})]:
        if name not in specs:
            raise NpuprepError(f"input '{name}' (in --input-range/--input-shape) is not an input of the model "
                               f"(inputs: {', '.join(sorted(specs))})")
    tables = index_limits(model)
    masks = mask_inputs(model)
    out = []
    for s in specs.values():
        if s.name in (shapes or {}):
            s = replace(s, shape=_override_shape(s, tuple(shapes[s.name])))
        if s.name in (ranges or {}):
            lo, hi = ranges[s.name]
            _check_range(s, float(lo), float(hi), tables.get(s.name))
            s = replace(s, low=float(lo), high=float(hi))
        elif s.name in tables and s.dtype.kind in "iu":
            s = replace(s, low=0.0, high=float(max(tables[s.name] - 1, 0)))
        elif s.name in masks:
            s = replace(s, mask=True)
        out.append(s)
    if shapes:
        _check_fits(model, out, shapes)
    return SampleSet("synthetic", "synthetic", tuple(out), count=count, seed=seed)


def _check_range(spec: InputSpec, lo: float, hi: float, table: int | None) -> None:
    """The range must hold values of the input's type, and the rows of a table it indexes."""
    import ml_dtypes

    where = f"--input-range {spec.name}:{lo:g}:{hi:g}"
    if spec.dtype == np.bool_:
        return
    if spec.dtype.kind in "iu":
        info = np.iinfo(spec.dtype)
        if lo < info.min or hi > info.max:
            raise NpuprepError(f"{where}: input '{spec.name}' is {spec.dtype.name}, whose values lie in "
                               f"{info.min}..{info.max}")
        if table is not None and (hi > table - 1 or lo < -table):
            raise NpuprepError(f"{where}: input '{spec.name}' indexes a table of {table} rows: give a "
                               f"range within 0..{table - 1}")
        return
    largest = float(ml_dtypes.finfo(spec.dtype).max)
    if max(abs(lo), abs(hi)) > largest:
        raise NpuprepError(f"{where}: input '{spec.name}' is {spec.dtype.name}, whose largest value is "
                           f"{largest:g}")
    if not math.isfinite(hi - lo):
        raise NpuprepError(f"{where}: the range is wider than the largest float; give a narrower one")


def _override_shape(spec: InputSpec, dims: tuple[int, ...]) -> tuple[int, ...]:
    if len(dims) != len(spec.shape) or any(d < 1 for d in dims):
        raise NpuprepError(f"--input-shape {spec.name}: {list(dims)} does not fit the input's rank "
                           f"{len(spec.shape)} (or has a dimension < 1)")
    for axis, (want, got) in enumerate(zip(spec.shape, dims, strict=True)):
        if want is not None and want != got:
            raise NpuprepError(f"--input-shape {spec.name}: dimension {axis} is fixed at {want} in the model, "
                               f"not {got}")
    return dims


def _check_fits(model: onnx.ModelProto, specs: list[InputSpec], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Refuse input sizes whose run cannot fit this machine (or --max-memory): it would fail
    or swap long after the command started."""
    need = sample_size(model, {s.name: tuple(d or 1 for d in s.shape) for s in specs})
    limits = [(m, w) for m, w in ((_physical_memory(), "this machine's memory"),
                                  (memory_budget(), "--max-memory")) if m]
    limit, what = min(limits, default=(0, ""))
    if not limit or need.run_bytes <= limit:
        return
    given = " ".join(f"{n}:{'x'.join(map(str, d))}" for n, d in shapes.items())
    raise NpuprepError(f"--input-shape {given}: a run needs at least {need.run_bytes / 2**30:.3g} GiB "
                       f"(node '{need.node}' reads and writes {need.node_bytes / 2**30:.3g} GiB per "
                       f"sample), over {what} ({limit / 2**30:.3g} GiB); give smaller dimensions")


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0




def index_limits(model: onnx.ModelProto) -> dict[str, int]:
    """Integer graph inputs that index a constant table: input -> the table's size on the gathered axis.

    Follows Cast/Reshape/Unsqueeze/... from the input to `Gather(table, indices)` with `table`
    an initialiser or Constant; the smallest table wins when one input indexes several.
    """
    g = model.graph
    sizes = {i.name: tuple(i.dims) for i in g.initializer}
    for node in g.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            sizes[node.output[0]] = tuple(node.attribute[0].t.dims)
    readers = _readers(g)
    limits: dict[str, int] = {}
    for vi in g.input:
        if vi.name in sizes:
            continue
        for node, name in _reached(vi.name, readers):
            if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] == name \
                    and node.input[0] in sizes:
                dims = sizes[node.input[0]]
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                if dims and -len(dims) <= axis < len(dims):
                    limits[vi.name] = min(limits.get(vi.name, dims[axis]), dims[axis])
    return limits


def _reached(start: str, readers: dict[str, list[onnx.NodeProto]]) -> Iterator[tuple[onnx.NodeProto, str]]:
    """(node, tensor it reads) for each node reading `start`, or what an index-preserving op
    (PASSTHROUGH_OPS, followed rather than yielded) made of it."""
    frontier, seen = [start], set()
    while frontier:
        name = frontier.pop()
        if name in seen:
            continue
        seen.add(name)
        for node in readers.get(name, []):
            if node.op_type in PASSTHROUGH_OPS and node.input[0] == name:
                frontier.append(node.output[0])
            else:
                yield node, name


def _readers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """tensor -> the nodes of `graph` that read it."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    return readers


# Ops whose reading of an input makes it a selector, not a value (what a mask feeds).
_MASK_READERS = ("Where", "Equal", "Not", "And", "Or", "Less", "Greater", "LessOrEqual", "GreaterOrEqual")


def mask_inputs(model: onnx.ModelProto) -> set[str]:
    """Integer or bool inputs that look like masks: named so (`attention_mask`), or read (through
    Cast/Reshape/...) only by Where and comparisons. Random 0..3 values there would mask whole
    rows, which a real mask never does."""
    g = model.graph
    inits = {i.name for i in g.initializer}
    readers = _readers(g)
    found = set()
    for vi in g.input:
        elem = vi.type.tensor_type.elem_type
        if vi.name in inits or elem not in (onnx.TensorProto.BOOL, *_INT_TYPES):
            continue
        if "mask" in vi.name.lower():
            found.add(vi.name)
            continue
        ends = [node.op_type for node, _ in _reached(vi.name, readers)]
        if ends and all(op in _MASK_READERS for op in ends):
            found.add(vi.name)
    return found


_INT_TYPES = (onnx.TensorProto.INT8, onnx.TensorProto.INT16, onnx.TensorProto.INT32, onnx.TensorProto.INT64,
              onnx.TensorProto.UINT8, onnx.TensorProto.UINT16, onnx.TensorProto.UINT32, onnx.TensorProto.UINT64)


def _mask_values(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """0/1 with at least one 1 in every row (last axis): a row masked whole softmaxes to NaN."""
    values = rng.integers(0, 2, shape)
    if values.ndim and values.shape[-1]:
        rows = values.reshape(-1, values.shape[-1])
        rows[np.arange(len(rows)), rng.integers(0, values.shape[-1], len(rows))] = 1
    return values.astype(dtype)


def _synthetic_feed(specs: tuple[InputSpec, ...], seed: int, index: int) -> Feed:
    rng = np.random.default_rng([seed, index])
    feed: Feed = {}
    for s in specs:
        shape = tuple(d if d is not None else 1 for d in s.shape)
        if np.issubdtype(s.dtype, np.floating) or s.dtype.kind == "V":
            if s.low is not None and s.high is not None:
                feed[s.name] = rng.uniform(s.low, s.high, shape).astype(s.dtype)
            else:
                feed[s.name] = rng.standard_normal(shape).astype(s.dtype)
        elif s.mask:
            feed[s.name] = _mask_values(rng, shape, s.dtype)
        elif s.dtype == np.bool_:
            feed[s.name] = rng.integers(0, 2, shape).astype(np.bool_)
        else:
            low = 0 if s.low is None else math.ceil(s.low)
            high = 3 if s.high is None else max(math.floor(s.high), low)
            feed[s.name] = rng.integers(low, high, shape, endpoint=True).astype(s.dtype)
    return feed


def _read_npz(path: Path) -> Feed:
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise NpuprepError(f"{path}: not a readable .npz file ({exc})") from None


def _polygraphy_count(path: Path) -> int:
    from polygraphy.json import load_json

    try:
        feeds = load_json(str(path))
    except Exception as exc:  # noqa: BLE001 - polygraphy raises many kinds on bad JSON
        raise NpuprepError(f"{path}: not a Polygraphy inputs JSON ({type(exc).__name__})") from None
    if not isinstance(feeds, list) or not all(isinstance(f, dict) for f in feeds) or not feeds:
        raise NpuprepError(f"{path}: Polygraphy inputs JSON must be a non-empty list of name->array maps")
    return len(feeds)


def _validate(feed: Feed, specs: tuple[InputSpec, ...], where: str) -> Feed:
    names = {s.name for s in specs}
    missing = [s.name for s in specs if s.name not in feed]
    if missing:
        raise NpuprepError(f"{where}: missing input '{missing[0]}' (model inputs: {', '.join(sorted(names))})")
    extra = sorted(set(feed) - names)
    if extra:
        raise NpuprepError(f"{where}: unknown input '{extra[0]}' (model inputs: {', '.join(sorted(names))})")
    out: Feed = {}
    for s in specs:
        arr = _as_low_float(np.asarray(feed[s.name]), s.dtype)
        if arr.dtype != s.dtype:
            raise NpuprepError(f"{where}: input '{s.name}' has dtype {arr.dtype}, the model expects {s.dtype}")
        if arr.ndim != len(s.shape) or any(
            d is not None and d != a for d, a in zip(s.shape, arr.shape, strict=False)
        ):
            want = tuple("?" if d is None else d for d in s.shape)
            raise NpuprepError(f"{where}: input '{s.name}' has shape {arr.shape}, the model expects {want}")
        if arr.dtype.kind == "f" or arr.dtype.kind == "V":
            values = arr.astype(np.float32)
            finite = np.isfinite(values)
            if not finite.all():
                nan = int(np.isnan(values).sum())
                first = tuple(int(i) for i in np.argwhere(~finite)[0])
                raise NpuprepError(
                    f"{where}: input '{s.name}' holds {nan} NaN and {int((~finite).sum()) - nan} Inf "
                    f"values (first at index {first}); samples must be finite"
                )
        out[s.name] = arr
    return out


def _as_low_float(arr: np.ndarray, want: np.dtype) -> np.ndarray:
    """A BF16/FP8 input as numpy stores it: `.npz` keeps ml_dtypes arrays as raw bytes
    (void of the same width), which are the values themselves; FP32 given for such an input
    is rounded to it (round to nearest even, as a Cast would)."""
    if want.kind != "V" or arr.dtype == want:
        return arr
    if arr.dtype.kind == "V" and arr.dtype.itemsize == want.itemsize:
        return arr.view(want)
    if arr.dtype == np.float32:
        return arr.astype(want)
    return arr
