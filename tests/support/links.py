"""A file and a directory outside output_dir for a planted symbolic link to point at
(conftest's `victim` fixture), and the check that nothing wrote through the link."""

VICTIM_TEXT = "precious\n"


def untouched(victim):
    assert victim.file.read_text() == VICTIM_TEXT
    assert sorted(p.name for p in victim.dir.iterdir()) == ["keep"]
    assert (victim.dir / "keep").read_text() == VICTIM_TEXT
