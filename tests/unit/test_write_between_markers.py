"""dspark_ds.files.write_between_markers: the docs' generated tables (tools/peer_compare.py,
tools/depth_study.py) replace what is between their markers and nothing else."""

from __future__ import annotations

from dspark_ds.files import write_between_markers

B, E = "<!-- begin -->", "<!-- end -->"


def test_only_the_block_between_the_markers_changes(tmp_path):
    md = tmp_path / "a.md"
    md.write_text(f"# title\n\nprose\n{B}\nold\n{E}\n\nafter\n")
    write_between_markers(md, B, E, "new table", header="# unused\n")
    assert md.read_text() == f"# title\n\nprose\n{B}\nnew table\n{E}\n\nafter\n"


def test_a_new_file_gets_the_header_and_a_file_without_markers_keeps_its_text(tmp_path):
    new = tmp_path / "new.md"
    write_between_markers(new, B, E, "t", header="# head\n")
    assert new.read_text() == f"# head\n\n{B}\nt\n{E}\n"
    bare = tmp_path / "bare.md"
    write_between_markers(bare, B, E, "t")
    assert bare.read_text() == f"{B}\nt\n{E}\n"
    kept = tmp_path / "kept.md"
    kept.write_text("user's notes\n")
    write_between_markers(kept, B, E, "t", header="# head\n")
    assert kept.read_text() == f"user's notes\n\n{B}\nt\n{E}\n"
    write_between_markers(kept, B, E, "u")  # again: replaced in place
    assert kept.read_text() == f"user's notes\n\n{B}\nu\n{E}\n"
