"""One place is one place (`reshard.read.place_of`, `refuse_overlap`): outputs and sources compared as the store
holding them sees them, whatever the spelling; and the bucket output and the S3 source spell a prefix alike."""

from __future__ import annotations

import os

import pytest

from reshard.errors import OutputError, UsageError
from reshard.read import place_of, refuse_overlap, s3_prefix

SAME_AS_B_RS = ["s3://b/rs", "s3://b/rs/", "s3://b//rs", "s3://b/./rs", "s3://b//rs//", "s3a://b/rs", "s3://B/rs",
                "s3://b/./rs/."]


@pytest.mark.parametrize("spelling", SAME_AS_B_RS)
def test_every_spelling_of_a_prefix_is_one_place(spelling):
    assert place_of(spelling).parts == ("b", "rs")
    with pytest.raises(OutputError, match=r"OUT .* is SRC s3://b/rs .*Nothing was changed"):
        refuse_overlap(spelling, "OUT", [("SRC", "s3://b/rs")])
    with pytest.raises(OutputError, match=r"is SRC"):
        refuse_overlap("s3://b/rs", "OUT", [("SRC", spelling)])


@pytest.mark.parametrize("out, source, relation", [
    ("s3://b//rs/sub", "s3://b/rs", "is inside"), ("s3://b/rs/./sub/", "s3://b//rs", "is inside"),
    ("s3://b//top", "s3://b/top/rs", "holds"), ("s3://b/top/", "s3://b//top//rs", "holds")])
def test_a_prefix_inside_or_above_the_source_is_refused(out, source, relation):
    with pytest.raises(OutputError, match=f"OUT {out} {relation} SRC"):
        refuse_overlap(out, "OUT", [("SRC", source)])


@pytest.mark.parametrize("out, source", [("s3://b/rs2", "s3://b/rs"), ("s3://b/r", "s3://b/rs"),
                                         ("s3://c/rs", "s3://b/rs"), ("s3://b/rs", "./rs"), ("s3://b/rs", "b/rs")])
def test_different_places_are_not_refused(out, source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refuse_overlap(out, "OUT", [("SRC", source)])  # raises if it took them for one place


def test_the_endpoint_is_part_of_the_place(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:1")
    here = place_of("s3://b/rs")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:2")
    there = place_of("s3://b/rs")
    assert not here.holds(there) and not there.holds(here)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:1")
    assert place_of("s3://b//rs/").holds(here)


def test_a_prefix_going_up_is_refused_not_guessed():
    with pytest.raises(UsageError, match=r"`\.\.` is ambiguous"):
        s3_prefix("s3://b/x/../rs")
    assert s3_prefix("s3://b//a/./b/") == ("b", "a/b") and s3_prefix("s3://b") == ("b", "")


def test_local_paths_are_compared_after_links_and_dotdot(tmp_path, monkeypatch):
    src = tmp_path / "models" / "src"
    src.mkdir(parents=True)
    (tmp_path / "link").symlink_to(src)
    (tmp_path / "up").symlink_to(tmp_path / "models" / "src")
    monkeypatch.chdir(tmp_path)
    for out, relation in [("models/src", "is"), ("models/x/../src", "is"), ("link", "is"), ("link/sub", "is inside"),
                          ("link/../", "holds"), ("up/..", "holds"), ("models", "holds"), (".", "holds")]:
        with pytest.raises(OutputError, match=f"OUT {out} {relation} SRC"):
            refuse_overlap(out, "OUT", [("SRC", src)])
    for out in ("models/srcx", "models/sr", "other"):
        refuse_overlap(out, "OUT", [("SRC", src)])
    # a new folder next to the source is not inside it, though the nearest folder that exists is the source's parent
    refuse_overlap(tmp_path / "models" / "new" / "deep", "OUT", [("SRC", src)])


def test_a_second_mount_of_the_source_folder_is_the_same_place(tmp_path):
    """A bind mount (or a case-folding file system) spells one folder two ways: its identity still matches."""
    src, other = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    other.mkdir()
    if os.system(f"mount --bind {src} {other} 2>/dev/null") != 0:
        pytest.skip("no bind mount here (needs root)")
    try:
        with pytest.raises(OutputError, match="is inside SRC"):
            refuse_overlap(other / "out", "OUT", [("SRC", src)])
    finally:
        os.system(f"umount {other}")


def test_a_hub_id_is_a_place_of_its_own_and_an_output_never_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert place_of("Org/Name") == place_of("org/name").__class__("hub", ("org", "name"), spelled="Org/Name")
    assert place_of("org/name", output=True).store == "local"  # OUT org/name is a folder, however it is spelled
    (tmp_path / "org" / "name").mkdir(parents=True)
    with pytest.raises(OutputError, match="is SRC"):  # a folder of that name exists: the source is that folder
        refuse_overlap("org/name", "OUT", [("SRC", "org/name")])


def test_none_and_several_sources(tmp_path):
    src, extras = tmp_path / "src", tmp_path / "extras"
    refuse_overlap(tmp_path / "out", "DEST", [("SRC", src), ("--extras-from", None)])
    with pytest.raises(OutputError, match=r"DEST .* holds --extras-from"):
        refuse_overlap(tmp_path, "DEST", [("SRC", tmp_path / "elsewhere" / ".." / ".." / "y"),
                                          ("--extras-from", extras)])


def test_an_output_is_never_a_whole_bucket():
    for spelling in ("s3://b", "s3://b/", "s3://b//./"):
        with pytest.raises(UsageError, match="not a whole bucket"):
            refuse_overlap(spelling, "OUT", [("SRC", "/x")])
    assert place_of("s3://bucket").parts == ("bucket",)  # a source may be one
