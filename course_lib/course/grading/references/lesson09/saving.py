"""Lesson 09a's expected values and explanations for the writing checks: `write_atomic` and
`save`."""

from __future__ import annotations

from course_lib.i18n import _

DURABLE = "fsynced, then renamed into place"


# --- write_atomic -----------------------------------------------------------------------------


def write_atomic(scenario: str) -> dict:
    if scenario == "killed":
        return {"file holds": "the old bytes"}
    return {"file holds": "all the new bytes", "error": None,
            "new bytes fsynced before the rename": True, "folder fsynced after the rename": True,
            "other files left in the folder": 0}


def explain_write_atomic(case, rank, expected, got) -> str | None:
    if not isinstance(got, dict):
        return None
    holds = str(got.get("file holds", ""))
    if holds.startswith("a mix"):
        return _("killed half-way, the file holds part of the new bytes over the old: the write "
                 "went to the file's own name, so a crash tears it")
    if holds == "nothing (gone)":
        return _("the old file was gone before the new one was whole: a crash at that moment "
                 "leaves no checkpoint at all")
    if "finished" in got:
        return _("the write did not finish within 10 s")
    if got.get("error"):
        return _("the write raised {error}", error=got["error"])
    if got.get("new bytes fsynced before the rename") is False:
        return _("the new bytes took the name before they were fsynced (or never took it by a "
                 "rename): after a power cut the name can point at a file whose bytes never "
                 "reached the disk")
    if got.get("folder fsynced after the rename") is False:
        return _("the folder was not fsynced after the rename: after a power cut the rename "
                 "itself can be lost and the old bytes come back")
    if got.get("other files left in the folder"):
        return _("{n} file(s) left beside the result: the temporary file must not outlive the "
                 "write", n=got["other files left in the folder"])
    return None


# --- save -------------------------------------------------------------------------------------


def save(rank: int, world_size: int, k: int, scenario: str) -> dict | None:
    if rank >= k:
        return None
    if scenario == "disk full":
        out = {"raised": f"CheckpointError naming rank {k - 1}",
               "own shard": "none" if rank == k - 1 else DURABLE}
        if rank == 0:
            out.update({"manifest": "the previous one, untouched",
                        "loads as": "the previous state"})
        return out
    out = {"raised": None, "own shard": DURABLE, "on return": "the new manifest is on disk"}
    if rank == 0:
        out.update({"manifest": "fsynced, renamed into place after every shard it names",
                    "loads as": "the new state"})
        if scenario == "over an old one":
            out["earlier files left"] = 0
    return out


def explain_save(case, rank, expected, got) -> str | None:
    if not isinstance(got, dict) or not isinstance(expected, dict):
        return None
    k = case.args[2]
    raised, want_raised = got.get("raised"), expected.get("raised")
    if want_raised and raised is None:
        return _("rank {rank} returned normally although rank {failed} could not write its "
                 "shard: every rank must hear of a failure and raise", rank=rank, failed=k - 1)
    if want_raised and raised != want_raised:
        if str(raised).startswith("CheckpointError"):
            return _("rank {rank} raised, but its error does not name rank {failed}, the rank "
                     "whose shard failed", rank=rank, failed=k - 1)
        return _("rank {rank} let {error} escape: the other ranks never hear of it and wait "
                 "for a rank that gave up", rank=rank, error=raised)
    if raised and not want_raised:
        return _("rank {rank} raised {error} on a save that should succeed", rank=rank,
                 error=raised)
    manifest = str(got.get("manifest", ""))
    if "manifest" in expected and manifest != expected["manifest"]:
        if "before rank" in manifest:
            return _("the manifest was renamed into place {when}: it went down before every "
                     "shard was known to be whole", when=manifest.split("place ", 1)[-1])
        if manifest == "written in place (no rename)":
            return _("the manifest was written under its own name, not renamed into place: a "
                     "crash mid-write leaves a torn manifest")
        if manifest == "renamed into place without an fsync first":
            return _("the manifest was renamed into place without an fsync first")
        if manifest.startswith("renamed into place, the folder"):
            return _("the folder was not fsynced after the manifest's rename")
        if expected["manifest"] == "the previous one, untouched":
            return _("a new manifest went down although rank {failed} failed: it names a shard "
                     "that is not on disk, and the previous checkpoint is lost",
                     failed=k - 1)
        if manifest == "none":
            return _("no manifest was written: the save never becomes a checkpoint")
    shard = got.get("own shard")
    if shard != expected.get("own shard"):
        if shard == "renamed into place without an fsync first":
            return _("rank {rank}'s shard was renamed into place before it was fsynced",
                     rank=rank)
        if shard == "written under its final name (no rename)":
            return _("rank {rank}'s shard was written under its final name, not renamed into "
                     "place", rank=rank)
        if shard == "none":
            return _("rank {rank} wrote no shard", rank=rank)
    if got.get("on return") == "no new manifest yet":
        return _("rank {rank} returned before the manifest was on disk: a crash right after "
                 "leaves its caller believing in a checkpoint that does not exist", rank=rank)
    if got.get("earlier files left"):
        return _("{n} file(s) of the earlier checkpoint were left in the folder",
                 n=got["earlier files left"])
    loads = str(got.get("loads as", ""))
    if "loads as" in expected and loads != expected["loads as"]:
        return _("the folder does not load as {want}: {got}", want=expected["loads as"],
                 got=loads)
    return None
