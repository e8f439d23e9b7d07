"""The benchmarks' request templates (``benchmarks._codec``) fill in to the codec's bytes."""

from __future__ import annotations

from benchmarks import _codec
from benchmarks.instructions import NOTE


def test_a_hold_template_filled_in_is_the_request_the_codec_builds_for_that_key() -> None:
    """The owner note ``benchmarks.instructions`` sends is percent-encoded (``celery%40...``):
    its ``%`` must survive the template's ``% key``, as in the ``hl + r`` rows' driver."""
    assert "%" in NOTE
    assert _codec.hold(33, NOTE) % b"k:1" == _codec.hold(33, NOTE, key="k:1")


def test_the_lock_and_release_templates_fill_in_to_the_codecs_bytes() -> None:
    assert _codec.lock(0, 33) % b"k:1" == _codec.lock(0, 33, key="k:1")
    assert _codec.RELEASE % (b"k:1", b"ab" * 16) == b"r\nk:1\n" + b"ab" * 16 + b"\n"
