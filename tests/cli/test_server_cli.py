"""`xstage-dit serve` options: documented in --help, bad values rejected with one line naming them."""

from __future__ import annotations

import pytest

from xstage_dit.cli import main


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for option in ("--model", "--sp", "--ep", "--cfg", "--host", "--port", "--max-queue", "--max-batch-size",
                   "--request-timeout", "--max-body-bytes", "--heartbeat-timeout", "--weights-seed", "XSTAGE_API_KEY"):
        assert option in text, option


@pytest.mark.parametrize("argv, named", [
    (["--cfg", "3"], "--cfg"),
    (["--sp", "0"], "--sp"),
    (["--sp", "2", "--ep", "3"], "--ep"),
    (["--model", "no-such-model"], "--model"),
    (["--max-queue", "0"], "--max-queue"),
    (["--max-batch-size", "-1"], "--max-batch-size"),
    (["--port", "70000"], "--port"),
    (["--collective-timeout", "0"], "--collective-timeout"),
])
def test_bad_values_give_one_line_errors(capsys, argv, named):
    with pytest.raises(SystemExit) as exc:
        main(["serve", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and named in err and err.startswith("xstage-dit: error:"), err
