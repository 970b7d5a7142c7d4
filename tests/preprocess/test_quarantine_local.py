"""Every bad-record kind is quarantined with its reason, in the same chunk as good records."""

from __future__ import annotations

import json

from pipeline.preprocess.sample import ProcessedSample, QuarantinedRecord

from .conftest import chat, make_job, processor_for, src

BAD = [
    (b'{"messages": [{"role": "user"', "bad_json"),
    (b'{"messages": [{"role": "user", "content": "\xff"}]}', "bad_utf8"),
    (json.dumps({"messages": [{"role": "user", "content": "q"}]}).encode(), "missing_roles"),
    (json.dumps({"conversations": [{"from": "human", "value": "<image>x"},
                                   {"from": "gpt", "value": "y"}],
                 "images": ["broken.jpg"]}).encode(), "bad_image"),
    (json.dumps({"conversations": [{"from": "human", "value": "<image>x"},
                                   {"from": "gpt", "value": "y"}],
                 "images": ["not_an_image.png"]}).encode(), "bad_image"),
    (json.dumps({"conversations": [{"from": "human", "value": "<image>x"},
                                   {"from": "gpt", "value": "y"}],
                 "images": ["nowhere/gone.png"]}).encode(), "missing_image"),
    (json.dumps(chat(user="literal <|image_pad|> in text")).encode(),
     "special_tokens_in_content"),
]


def _strict():
    """A job that quarantines special-token strings in content (the default reads them as
    text: test_template_injection.py)."""
    return make_job(special_tokens_in_content="quarantine")


def test_bad_records_quarantined_good_ones_flow(image_dir):
    good = json.dumps(chat()).encode()
    rows = []
    for line, _ in BAD:
        rows += [good, line]
    rows.append(good)
    f = src(image_dir / "data.jsonl")
    out = processor_for(_strict()).process(f, list(enumerate(rows)))
    assert len(out) == len(rows)
    assert [o.row for o in out] == list(range(len(rows)))
    q = [o for o in out if isinstance(o, QuarantinedRecord)]
    assert [(o.row, o.reason) for o in q] == [(2 * i + 1, r) for i, (_, r) in enumerate(BAD)]
    assert all(o.detail for o in q) and all(o.source == f.source for o in q)
    assert sum(isinstance(o, ProcessedSample) for o in out) == len(BAD) + 1


def test_template_error_is_quarantined(tmp_path):
    path = tmp_path / "strict.jinja"
    # (A template sees no content, only its place: it can refuse a conversation's shape.)
    path.write_text("{% if messages[0].role == 'system' %}"
                    "{{ raise_exception('no system turns allowed') }}{% endif %}"
                    "{% for m in messages %}"
                    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    out = processor_for(make_job(chat_template=str(path))).process(
        src(), [(0, json.dumps(chat(system="S")).encode()), (1, json.dumps(chat()).encode())])
    assert out[0].reason == "template_error" and "no system" in out[0].detail
    assert isinstance(out[1], ProcessedSample)


def test_reasons_are_one_vocabulary_from_record_to_row(image_dir):
    """The reason stays the vocabulary member through the Arrow row (no sentence parsing)."""
    from pipeline.preprocess.rows import from_table, to_table
    from pipeline.quarantine import QuarantineReason

    assert all(r.meaning and r.value == r.value.lower() for r in QuarantineReason)
    out = processor_for(_strict()).process(
        src(image_dir / "data.jsonl"), [(i, line) for i, (line, _) in enumerate(BAD)])
    back = from_table(to_table(out))
    assert [type(o.reason) for o in back] == [QuarantineReason] * len(BAD)
    assert [o.reason for o in back] == [QuarantineReason(r) for _, r in BAD]
    assert [o.detail for o in back] == [o.detail for o in out]
