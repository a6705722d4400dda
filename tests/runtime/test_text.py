"""The text assembler (engines/text.py): token bytes to text, stop strings held back until they
either match or diverge, UTF-8 split across tokens."""

from __future__ import annotations

from ember_runtime.engines.text import TextAssembler


def feed(assembler: TextAssembler, pieces: list[bytes]) -> tuple[str, bool]:
    out = ""
    for piece in pieces:
        text, stopped = assembler.push(piece)
        out += text
        if stopped:
            return out, True
    return out + assembler.flush(), False


def test_stop_string_split_across_tokens_is_not_emitted() -> None:
    text, stopped = feed(TextAssembler(("END",)), [b"abc E", b"N", b"D more"])
    assert (text, stopped) == ("abc ", True)


def test_partial_stop_prefix_is_released_when_it_diverges() -> None:
    assembler = TextAssembler(("END",))
    assert assembler.push(b"x EN") == ("x ", False)  # "EN" held back
    assert assembler.push(b"ough") == ("ENough", False)


def test_earliest_stop_wins() -> None:
    assert feed(TextAssembler(("b", "a")), [b"xxab"]) == ("xx", True)


def test_utf8_split_across_tokens() -> None:
    euro = "€".encode()
    text, stopped = feed(TextAssembler(()), [euro[:1], euro[1:2], euro[2:] + b"!"])
    assert (text, stopped) == ("€!", False)
    assembler = TextAssembler(())
    assert assembler.push(euro[:2]) == ("", False)
