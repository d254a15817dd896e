"""Command-line sizes: one exact parser, argparse-friendly errors of the flexsp family."""
import argparse

import pytest

from flexsp.errors import FlexSPError, SizeError
from flexsp.inputs import parse_size, parse_sizes, parse_tokens


@pytest.mark.parametrize("text, value", [("393216", 393216), ("384K", 384 * 1024), ("384k", 393216),
                                         ("2M", 2 * 1024 ** 2), ("1.5M", 1_572_864), (" 4 K ", 4096),
                                         ("1G", 1024 ** 3), ("0.5K", 512)])
def test_sizes(text, value):
    assert parse_size(text) == value
    assert parse_tokens(text) == value


@pytest.mark.parametrize("text", ["", "K", "-4", "4KB", "1e3", "1.3", "0.1K", "0", str(2 ** 62 + 1), "4T"])
def test_bad_sizes_are_refused_not_truncated(text):
    with pytest.raises(SizeError) as info:
        parse_size(text)
    assert isinstance(info.value, FlexSPError) and isinstance(info.value, argparse.ArgumentTypeError)
    assert repr(text) in str(info.value)


def test_lists_and_argparse_message():
    assert parse_sizes("256,1K, 4K,") == [256, 1024, 4096]
    with pytest.raises(SizeError):
        parse_sizes(" , ")
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--context", type=parse_tokens)
    with pytest.raises(argparse.ArgumentError, match="expected a whole token count"):
        parser.parse_args(["--context", "1.3"])
