"""Numbers typed by people: one bounded parser for counts and sizes, and the CLI options that use it.

Whatever the text (``²``, Arabic-Indic digits, 5,000 digits, 400 digits of
bytes), the answer is a one-line ``InvalidNumberError`` or click's usage error
(exit 2), never a traceback, and nothing published is touched.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from registry import Registry
from registry.errors import InvalidNumberError, PolicyError, RegistryError
from registry.format import numbers
from registry.format.numbers import MAX_INT, parse_int, parse_size
from tests.helpers import make_state

HUGE = "9" * 5000  # past Python's int-conversion digit limit
HUGE_BYTES = "1" + "0" * 400  # float() of it is inf, int(inf) overflows
NOT_ASCII = ("²", "١٢", "１２", "1²")  # str.isdigit() accepts the first; int() accepts the others


def one_short_line(message: str) -> bool:
    return "\n" not in message.strip() and len(message) < 400


def test_parse_int_reads_ascii_digits_within_its_bounds() -> None:
    assert parse_int("42") == 42 and parse_int(" 7 ") == 7 and parse_int("0007") == 7
    assert parse_int(str(MAX_INT)) == MAX_INT and parse_int("0" * 30 + "5") == 5
    assert parse_int("-3", minimum=-5) == -3 and parse_int("65535", maximum=65535) == 65535
    for bad in (*NOT_ASCII, "", " ", "1_000", "1e3", "1.0", "0x10", "--1", "12abc", HUGE, str(MAX_INT + 1), "-1"):
        with pytest.raises(InvalidNumberError) as caught:
            parse_int(bad)
        assert one_short_line(str(caught.value)), bad
    with pytest.raises(InvalidNumberError, match="too small: at least 1"):
        parse_int("0", minimum=1)
    with pytest.raises(InvalidNumberError, match="at most 65535"):
        parse_int("65536", maximum=65535)
    with pytest.raises(InvalidNumberError, match=r"keep-last '9+'\.\.\. \(5000 characters\)"):
        parse_int(HUGE, what="keep-last")
    assert issubclass(InvalidNumberError, RegistryError) and issubclass(InvalidNumberError, ValueError)


def test_parse_size_is_exact_and_bounded() -> None:
    from registry.ops import policies
    assert policies.parse_size is numbers.parse_size  # one home
    assert parse_size("10G") == 10 * 1000**3 and parse_size("2 GiB") == 2 << 30 and parse_size("123") == 123
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size("0.5KiB") == 512 and parse_size("1.1GB") == 1_100_000_000
    assert parse_size("8TiB") == 8 << 40 and parse_size(" 5 mb ") == 5_000_000
    for bad in (HUGE_BYTES, HUGE_BYTES + "GB", HUGE, "9" * 19 + "TB", "1." + "5" * 400 + "GB", "²GB", "١٢MB",
                "1.5.5G", "1e3", "5 parsecs", "-1G", "", "G"):
        with pytest.raises(InvalidNumberError) as caught:
            parse_size(bad)
        assert one_short_line(str(caught.value)), bad
    with pytest.raises(InvalidNumberError, match="at least 1 bytes"):
        parse_size("0", minimum=1)


@pytest.mark.parametrize("text", ["keep-last ²", f"keep-last {HUGE}", f"keep-every {HUGE}", "keep-every ١٢",
                                  f"keep-best eval/loss {HUGE}", "keep-best eval/loss ²", f"max-bytes {HUGE_BYTES}",
                                  f"keep-last 1, max-bytes {HUGE_BYTES}GB"])
def test_policy_text_with_a_bad_number_is_a_policy_error(text: str) -> None:
    from registry.ops.policies import parse_policy_text
    with pytest.raises(PolicyError) as caught:
        parse_policy_text(text)
    assert one_short_line(str(caught.value))


@pytest.fixture
def published(catalog_url: str, root: Path) -> dict[int, str]:
    with Registry.open(url=catalog_url, root=root) as reg:
        for step in (1, 2, 3):
            reg.publish("alpha", step, make_state(step), metrics={"eval/loss": 1.0 / step})
        return {i.step: i.status for i in reg.checkpoints("alpha", include_deleted=True)}


BAD_OPTIONS = [
    ("gc", "alpha", "--max-bytes", HUGE_BYTES),
    ("gc", "alpha", "--max-bytes", HUGE_BYTES + "GB"),
    ("gc", "alpha", "--max-bytes", "²G"),
    ("gc", "alpha", "--keep-last", HUGE),
    ("gc", "alpha", "--keep-last", "١"),  # int() reads it as 1: gc would delete two steps
    ("gc", "alpha", "--keep-every", "²"),
    ("gc", "alpha", "--keep-last", "0"),
    ("ls", "alpha", "--policy-version", HUGE),
    ("export", "alpha@3", "OUT", "--format", "hf", "--max-shard-size", HUGE_BYTES),
    ("export", "alpha@3", "OUT", "--format", "hf", "--max-shard-size", "0"),
    ("checkout", "alpha@3", "OUT", "--ttl", "1" + "0" * 30),
    ("import", "SRC", "--run", "alpha", "--step", str(2**64)),
    ("import", "SRC", "--run", "alpha", "--step", HUGE),
    ("ui", "--port", HUGE),
    ("ui", "--port", "٨٠٠٠"),
]


def test_a_bad_numeric_option_is_a_usage_error(cli, published: dict[int, str], catalog_url: str,  # type: ignore[no-untyped-def]
                                               root: Path, tmp_path: Path) -> None:
    for args in BAD_OPTIONS:
        args = tuple(str(tmp_path / a) if a in ("OUT", "SRC") else a for a in args)
        result = cli(*args)
        assert result.exit_code == 2, (args, result.output)
        error = [line for line in result.output.splitlines() if line.startswith("Error:")]
        assert len(error) == 1 and f"'{args[-2]}'" in error[0] and len(error[0]) < 300, (args, result.output)
        assert "Traceback" not in result.output and len(result.output) < 1500, args
        assert not (tmp_path / "OUT").exists()
    with Registry.open(url=catalog_url, root=root) as reg:
        assert {i.step: i.status for i in reg.checkpoints("alpha", include_deleted=True)} == published


def test_good_numeric_options_still_work(cli, published: dict[int, str], tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    plan = cli("gc", "alpha", "--keep-last", "2", "--max-bytes", "1.5GB", "--dry-run")
    assert plan.exit_code == 0 and "MaxBytes(1500000000" in plan.output, plan.output
    out = cli("export", "alpha@3", str(tmp_path / "hf"), "--format", "hf", "--max-shard-size", "1KiB")
    assert out.exit_code == 0, out.output
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1


def test_a_step_of_5000_digits_is_a_bad_ref(cli, published: dict[int, str]) -> None:  # type: ignore[no-untyped-def]
    result = cli("show", f"alpha@{HUGE}")
    assert result.exit_code == 1 and "does not fit in 64 bits" in result.output, result.output
    assert one_short_line(result.output)
