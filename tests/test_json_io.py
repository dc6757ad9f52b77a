"""read_json: every JSON file npuprep reads fails the same way, in one line naming file and kind."""

from __future__ import annotations

import pytest

from npuprep.errors import NpuprepError
from npuprep.json_io import read_json


def test_read_json_reads_and_names_the_file_and_what_it_should_be(tmp_path):
    good = tmp_path / "s.json"
    good.write_text('{"kind": "stats", "x": [1, 2]}')
    assert read_json(good, "stats file") == {"kind": "stats", "x": [1, 2]}
    bad = tmp_path / "bad.json"
    bad.write_text('{"kind": ')
    cases = ((tmp_path / "none.json", "none.json: stats file not found"),
             (tmp_path, "cannot read the stats file"),
             (bad, "bad.json: not a valid stats file (JSON line 1: Expecting value)"))
    for path, said in cases:
        with pytest.raises(NpuprepError) as err:
            read_json(path, "stats file")
        assert said in str(err.value) and "\n" not in str(err.value)
