"""Make chat datasets from text and images that installed packages carry (no network).

    python -m pipeline.sample_data.generate --out FILE --n N --seed S [--mean-tokens M]
        [--sigma SIG] [--image-frac F] [--with-bad]
    python -m pipeline.sample_data.generate --shipped   # rebuilds the committed sample set

Text: Python's own documentation topics (`pydoc_data.topics`) and numpy docstrings. Images: the
scikit-image sample pictures saved small under images/ (written by --shipped). Assistant answer
lengths are log-normal (a long tail, like real SFT data): target tokens ~ LogNormal with the
given mean and sigma, at ~4 characters per token. Deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import textwrap
from pathlib import Path

from pipeline.sample_data import IMAGES_DIR, SAMPLE_CHATS

# (skimage.data function, saved file name, max side in pixels)
IMAGES = [
    ("astronaut", "astronaut.jpg", 256),
    ("coffee", "coffee.jpg", 256),
    ("chelsea", "chelsea.jpg", 224),
    ("rocket", "rocket.jpg", 224),
    ("retina", "retina.jpg", 224),
    ("hubble_deep_field", "hubble.jpg", 256),
    ("page", "page.png", 384),
    ("text", "text.png", 320),
]
TRUNCATED_IMAGE = "truncated.jpg"
MISSING_IMAGE = "does_not_exist.png"
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise technical writer. Answer precisely.",
    "You are a patient teacher who explains Python to beginners.",
]
USER_ASKS = [
    "Explain the Python topic '{t}'.",
    "What does the Python reference say about {t}?",
    "Can you describe how {t} works in Python?",
    "I am confused about {t}. Please explain.",
    "Give me an overview of '{t}' in Python.",
]
FOLLOW_UPS = ["Tell me more.", "Can you go on?", "What else should I know?", "Continue, please."]
IMAGE_ASKS = ["Describe this image.", "What is shown in this picture?",
              "What can you tell me about this image?"]


def _paragraphs(text: str, keep_lines: bool = False) -> list[str]:
    # Prose is re-flowed; docstrings keep their line structure (parameter lists, examples).
    if keep_lines:
        paras = [textwrap.dedent(p).strip() for p in textwrap.dedent(text).split("\n\n")]
    else:
        paras = [" ".join(p.split()) for p in text.split("\n\n")]
    return [p for p in paras if len(p) >= 40]


def corpus() -> list[tuple[str, list[str]]]:
    """(topic, paragraphs) from the stdlib docs and numpy docstrings, in a fixed order."""
    import pydoc_data.topics as topics

    import numpy as np

    out = [(name, _paragraphs(text)) for name, text in sorted(topics.topics.items())]
    for name in sorted(dir(np)):
        obj = getattr(np, name, None)
        doc = getattr(obj, "__doc__", None)
        if callable(obj) and isinstance(doc, str) and len(doc) > 400 and not name.startswith("_"):
            out.append((f"numpy.{name}", _paragraphs(doc, keep_lines=True)))
    return [(t, p) for t, p in out if p]


CAPTIONS = IMAGES_DIR / "captions.json"


def image_captions() -> dict[str, str]:
    """Captions written next to the images by --shipped (so only that needs scikit-image)."""
    if CAPTIONS.is_file():
        return json.loads(CAPTIONS.read_text())
    return _captions_from_skimage()


def _captions_from_skimage() -> dict[str, str]:
    import skimage.data as d

    caps = {}
    for fn, fname, _ in IMAGES:
        doc = getattr(d, fn).__doc__ or fn
        caps[fname] = " ".join(doc.split("\n\n")[0].split()) + " " + " ".join(
            " ".join(p.split()) for p in doc.split("\n\n")[1:3] if "Notes" not in p)
    return caps


def write_images(folder: Path = IMAGES_DIR) -> None:
    import skimage.data as d
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for fn, fname, side in IMAGES:
        im = Image.fromarray(getattr(d, fn)())
        im.thumbnail((side, side), Image.Resampling.LANCZOS)
        if fname.endswith(".jpg"):
            im.convert("RGB").save(folder / fname, quality=80, optimize=True)
        else:
            im.save(folder / fname, optimize=True)
    (folder / CAPTIONS.name).write_text(json.dumps(_captions_from_skimage(), indent=1) + "\n")
    whole = (folder / "astronaut.jpg").read_bytes()
    (folder / TRUNCATED_IMAGE).write_bytes(whole[: len(whole) // 2])  # a broken download


def _answer(rng: random.Random, paras: list[str], target_chars: int, start: int) -> tuple[str, int]:
    """Paragraphs from `start` (wrapping) until about `target_chars`."""
    out: list[str] = []
    n = 0
    i = start
    while n < target_chars:
        p = paras[i % len(paras)]
        if n + len(p) > target_chars and out:
            cut = max(40, target_chars - n)
            p = p[:cut].rsplit(" ", 1)[0] + "."
        out.append(p)
        n += len(p) + 2
        i += 1
    return "\n\n".join(out), i


def _emit(rng: random.Random, turns: list[tuple[str, str]], images: list[str],
          system: str | None) -> dict:
    """Render as OpenAI `messages` or ShareGPT `conversations` (half each)."""
    if rng.random() < 0.5:
        msgs = []
        pool = list(images)
        for role, text in turns:
            if "<image>" in text:
                parts = []
                for k, piece in enumerate(text.split("<image>")):
                    if k:
                        parts.append({"type": "image", "image": pool.pop(0)})
                    if piece.strip():
                        parts.append({"type": "text", "text": piece.strip()})
                msgs.append({"role": role, "content": parts})
            else:
                msgs.append({"role": role, "content": text})
        rec: dict = {"messages": msgs}
    else:
        rec = {"conversations": [{"from": "human" if r == "user" else "gpt", "value": t}
                                 for r, t in turns]}
        if images:
            rec["images"] = images
    if system:
        rec["system"] = system
    return rec


def generate(n: int, seed: int, mean_tokens: float = 400.0, sigma: float = 0.9,
             image_frac: float = 0.15, image_prefix: str = "images",
             max_tokens: int = 8000) -> list[dict]:
    rng = random.Random(seed)
    docs = corpus()
    caps = image_captions()
    names = [f for _, f, _ in IMAGES]
    mu = math.log(mean_tokens) - sigma**2 / 2  # so that E[target] = mean_tokens
    records = []
    for _ in range(n):
        target = min(max_tokens, max(8, int(rng.lognormvariate(mu, sigma))))
        n_turns = rng.choice([1, 1, 1, 2, 2, 3])
        system = rng.choice(SYSTEM_PROMPTS) if rng.random() < 0.3 else None
        images: list[str] = []
        turns: list[tuple[str, str]] = []
        if rng.random() < image_frac:
            picked = rng.sample(names, 2 if rng.random() < 0.2 else 1)
            images = [f"{image_prefix}/{f}" for f in picked]
            ask = ("Compare these two images." if len(picked) == 2 else rng.choice(IMAGE_ASKS))
            turns.append(("user", "<image>" * len(picked) + "\n" + ask))
            cap = " ".join(caps[f] for f in picked)
            turns.append(("assistant", cap[: max(60, target * 4)]))
            n_turns -= 1
            topic, paras = rng.choice(docs)
        else:
            topic, paras = rng.choice(docs)
            turns.append(("user", rng.choice(USER_ASKS).format(t=topic)))
            text, pos = _answer(rng, paras, max(40, target * 4 // n_turns), rng.randrange(
                len(paras)))
            turns.append(("assistant", text))
            n_turns -= 1
            for _ in range(n_turns):
                turns.append(("user", rng.choice(FOLLOW_UPS)))
                text, pos = _answer(rng, paras, max(40, target * 4 // (len(turns) // 2 + 1)),
                                    pos)
                turns.append(("assistant", text))
        records.append(_emit(rng, turns, images, system))
    return records


def bad_lines(image_prefix: str = "images") -> list[tuple[int, bytes, str]]:
    """(position, line bytes, why): one of each kind the pipeline must quarantine."""
    good = {"messages": [{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "hello"}]}
    return [
        (17, json.dumps(good)[:25].encode(), "bad_json: cut-off line"),
        (53, json.dumps({"messages": [{"role": "user", "content": "anyone there?"}]}).encode(),
         "missing_roles: no assistant turn"),
        (89, b'{"messages": [{"role": "user", "content": "caf\xe9"}, '
             b'{"role": "assistant", "content": "ok"}]}', "bad_utf8: latin-1 byte"),
        (131, json.dumps({"conversations": [{"from": "human", "value": "<image>\nWhat is it?"},
                                            {"from": "gpt", "value": "A picture."}],
                          "images": [f"{image_prefix}/{TRUNCATED_IMAGE}"]}).encode(),
         "bad_image: truncated JPEG"),
        (177, json.dumps({"messages": [
            {"role": "user", "content": [{"type": "image", "image":
                                          f"{image_prefix}/{MISSING_IMAGE}"},
                                         {"type": "text", "text": "Describe it."}]},
            {"role": "assistant", "content": "It is missing."}]}).encode(),
         "missing_image: path does not exist"),
        (211, json.dumps({"conversations": [{"value": "no speaker"},
                                            {"from": "gpt", "value": "?"}]}).encode(),
         "missing_roles: turn without 'from'"),
    ]


def write_jsonl(path: Path, records: list[dict], bad: list[tuple[int, bytes, str]]) -> None:
    lines = [json.dumps(r, ensure_ascii=False).encode("utf-8") for r in records]
    for pos, line, _ in sorted(bad):
        lines.insert(min(pos, len(lines)), line)
    path.write_bytes(b"\n".join(lines) + b"\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.sample_data.generate",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mean-tokens", type=float, default=400.0)
    ap.add_argument("--sigma", type=float, default=0.9, help="log-normal sigma (tail weight)")
    ap.add_argument("--image-frac", type=float, default=0.15)
    ap.add_argument("--with-bad", action="store_true", help="insert one bad record of each kind")
    ap.add_argument("--shipped", action="store_true",
                    help="rebuild the committed pipeline/sample_data set (images + chats.jsonl)")
    args = ap.parse_args(argv)
    if args.shipped:
        write_images()
        records = generate(294, seed=0)
        write_jsonl(SAMPLE_CHATS, records, bad_lines())
        print(f"wrote {SAMPLE_CHATS} ({len(records) + len(bad_lines())} lines)")
        return 0
    if args.out is None:
        ap.error("--out is required (or --shipped)")
    out = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    if not IMAGES_DIR.is_dir():
        write_images()
    # Image paths are relative to the output file (the pipeline resolves them that way).
    prefix = os.path.relpath(IMAGES_DIR, out.parent)
    records = generate(args.n, args.seed, args.mean_tokens, args.sigma, args.image_frac,
                       image_prefix=prefix)
    write_jsonl(out, records, bad_lines(prefix) if args.with_bad else [])
    print(f"wrote {out} ({args.n} records{' + bad ones' if args.with_bad else ''})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
