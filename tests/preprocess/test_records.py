"""Record parsing: both chat formats, images referenced from turns, and precise failure reasons."""

from __future__ import annotations

import base64

import pytest

from pipeline.preprocess import records as R
from pipeline.preprocess.quarantine_reasons import QuarantineReason as Q


def test_openai_messages_with_system_and_image_parts():
    conv = R.parse_record({
        "system": "Be brief.",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Look: "},
                                         {"type": "image", "image": "a.png"},
                                         {"type": "image_url", "image_url": {"url": "b.jpg"}}]},
            {"role": "assistant", "content": "Two pictures."},
        ],
    })
    assert [t.role for t in conv.turns] == ["system", "user", "assistant"]
    assert [i.path for i in conv.images] == ["a.png", "b.jpg"]
    assert conv.turns[1].segments[0].text == "Look: "


def test_sharegpt_with_image_tags_and_untagged_images():
    conv = R.parse_record({"conversations": [{"from": "human", "value": "<image>\nWhat?"},
                                             {"from": "gpt", "value": "A cat."}],
                           "images": ["cat.jpg"]})
    assert [t.role for t in conv.turns] == ["user", "assistant"]
    assert conv.turns[0].segments[0].image.path == "cat.jpg"
    assert conv.turns[0].segments[1].text == "\nWhat?"
    # No <image> tag: the image goes before the first user turn's text (LLaVA convention).
    conv = R.parse_record({"conversations": [{"from": "human", "value": "What?"},
                                             {"from": "gpt", "value": "A cat."}],
                           "image": "cat.jpg"})
    assert conv.turns[0].segments[0].image.path == "cat.jpg"


def test_inline_image_bytes_and_data_uri():
    raw = b"\x89PNG fake"
    uri = "data:image/png;base64," + base64.b64encode(raw).decode()
    conv = R.parse_record({"messages": [
        {"role": "user", "content": [{"type": "image", "image": uri},
                                     {"type": "image", "image": {"bytes": raw, "path": None}}]},
        {"role": "assistant", "content": "ok"}]})
    assert [i.data for i in conv.images] == [raw, raw]


@pytest.mark.parametrize(("line", "reason"), [
    (b'{"messages": [', Q.BAD_JSON),
    (b"", Q.BAD_JSON),
    (b"[1, 2]", Q.BAD_RECORD),
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', Q.BAD_UTF8),
])
def test_decode_line_reasons(line, reason):
    with pytest.raises(R.RecordError) as err:
        R.decode_line(line)
    assert err.value.reason == reason


@pytest.mark.parametrize(("rec", "reason"), [
    ({"text": "no chat here"}, Q.MISSING_ROLES),
    ({"messages": [{"role": "user", "content": "only a question"}]}, Q.MISSING_ROLES),
    ({"messages": [{"content": "who?"}, {"role": "assistant", "content": "me"}]},
     Q.MISSING_ROLES),
    ({"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]},
     Q.MISSING_ROLES),
    ({"conversations": [{"value": "x"}, {"from": "gpt", "value": "y"}]}, Q.MISSING_ROLES),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "late"},
                   {"role": "assistant", "content": "y"}]}, Q.MISSING_ROLES),
    ({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]},
     Q.BAD_RECORD),
    ({"messages": "not a list"}, Q.BAD_RECORD),
    ({"conversations": [{"from": "human", "value": "<image><image>"},
                        {"from": "gpt", "value": "y"}], "images": ["one.png"]}, Q.MISSING_IMAGE),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": "https://x/y.png"}]},
                   {"role": "assistant", "content": "y"}]}, Q.MISSING_IMAGE),
])
def test_parse_record_reasons(rec, reason):
    with pytest.raises(R.RecordError) as err:
        R.parse_record(rec)
    assert err.value.reason == reason


def test_more_images_than_placeholders_is_refused():
    with pytest.raises(R.RecordError) as err:
        R.parse_record({"conversations": [{"from": "human", "value": "<image> one"},
                                          {"from": "gpt", "value": "y"}],
                        "images": ["a.png", "b.png"]})
    assert err.value.reason == Q.BAD_RECORD and "placeholders" in err.value.detail
