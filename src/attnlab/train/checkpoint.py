"""Checkpoints: a folder per checkpoint, written atomically, verified on load.

    RUN_DIR/last/ and RUN_DIR/best/, each holding
        model.safetensors   weights (safetensors.torch.save_model: tied weights stored once)
        config.json         the ModelConfig
        recipe.json         the training recipe the run was started with
        state.pt            optimizer, scheduler, RNG and data-loader state, step, counters
        ...                 extra files (the tokenizer)
        manifest.json       size and SHA-256 of every other file, written last

Atomic replacement: a checkpoint is written into `RUN_DIR/.tmp-NAME-PID` (the writer's own, so
no two processes share one), every file and the folder are fsynced, then `NAME` is renamed to
`.old-NAME`, the temporary folder to `NAME`, and `.old-NAME` removed. POSIX rename is atomic but
cannot replace a non-empty folder, hence two renames; a crash between them leaves `.old-NAME`
complete, and `resolve` falls back to it. A crash at any other moment leaves the previous `NAME`
untouched; the temporary folders of writers that no longer run are removed by the next save.
A write that fails (disk full, a file-size limit, no permission) removes its temporary folder
and raises CheckpointWriteError saying why and naming the previous checkpoint, still intact.
Loading checks every file against the manifest and names the one that is missing, truncated or
corrupt.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

from ..atomic import _alive
from ..atomic import fsync as _fsync
from ..config import ConfigError, ModelConfig
from ..errors import AttnlabError, excerpt, reading

MANIFEST = "manifest.json"
FORMAT = 1


class CheckpointError(AttnlabError, RuntimeError):
    """A checkpoint that is missing, incomplete, truncated or corrupt."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written (disk full, file too large, no permission): the
    previous one is untouched, and no temporary folder is left."""

    exit_status = 5  # apart from input errors (2): the machine, not the command, must change


# why a write failed, by errno: the words of the error message and the fix
WRITE_FAILURES = {
    errno.ENOSPC: "the disk is full: free space",
    errno.EDQUOT: "the disk quota is exceeded: free space or raise the quota",
    errno.EFBIG: "a file exceeds the file-size limit (ulimit -f, or the file system's largest "
    "file): raise the limit",
    errno.EACCES: "permission denied: make the run directory writable",
    errno.EPERM: "operation not permitted: make the run directory writable",
    errno.EROFS: "the file system is read-only: train into a writable folder",
    errno.EIO: "an I/O error (a failing disk or a lost network mount): check the storage",
}


def _why(err: BaseException) -> str:
    """The reason a write failed: from the errno of the error or of one it arose from (torch's
    writer reports `unexpected pos`, the OSError beneath it has the errno), else from a library's
    `(os error N)`, else the message itself."""
    seen: BaseException | None = err
    code = None
    while seen is not None and code is None:
        code = seen.errno if isinstance(seen, OSError) else None
        seen = seen.__cause__ or seen.__context__
    if code is None:
        found = re.search(r"os error (\d+)", str(err))
        code = int(found.group(1)) if found else None
    if code is None:
        return f"{type(err).__name__}: {excerpt(err)}"
    name = errno.errorcode.get(code, str(code))
    return f"{WRITE_FAILURES.get(code, os.strerror(code))} ({name})"


def _write_failed(run_dir: Path, name: str, step: Any, err: BaseException) -> CheckpointWriteError:
    prev = resolve(run_dir, name)
    kept = (
        f"the previous checkpoint {prev} (step {_step(prev)}) is intact"
        if prev is not None
        else f"there was no earlier {name!r} checkpoint"
    )
    at = f" of step {step}" if step is not None else ""
    return CheckpointWriteError(
        f"could not write checkpoint {name!r}{at} in {run_dir}: {_why(err)}; {kept}. Once "
        f"fixed, run the same command again (or --resume {run_dir}) to continue from there"
    )


def _step(folder: Path) -> Any:
    try:
        return json.loads((folder / MANIFEST).read_text()).get("step", "?")
    except (OSError, ValueError, AttributeError):
        return "?"


def _temp(run_dir: Path, name: str) -> Path:
    """This process's temporary folder for checkpoint `name`, after removing the ones of
    processes that no longer run (and an earlier layout's `.tmp-NAME`)."""
    prefix = f".tmp-{name}"
    for p in run_dir.glob(prefix + "*"):
        pid = p.name[len(prefix) + 1 :]
        if p.name == prefix or (
            pid.isdecimal() and (int(pid) == os.getpid() or not _alive(int(pid)))
        ):
            shutil.rmtree(p, ignore_errors=True)  # left by a crash: never complete
    return run_dir / f"{prefix}-{os.getpid()}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _swap(tmp: Path, final: Path) -> None:
    """Replace folder `final` by the complete folder `tmp` (see the module docstring)."""
    old = final.with_name(".old-" + final.name)
    if old.exists() and final.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync(final.parent)
    if old.exists():
        shutil.rmtree(old)


def resolve(run_dir: str | Path, name: str = "last") -> Path | None:
    """The folder of checkpoint `name` in a run, falling back to the one a crash left behind."""
    run_dir = Path(run_dir)
    for cand in (run_dir / name, run_dir / (".old-" + name)):
        if (cand / MANIFEST).exists():
            return cand
    return None


def best_or_last(run_dir: str | Path) -> Path | None:
    """A run's best checkpoint, else its last (a run that never evaluated keeps only `last/`);
    None when it has neither. Every reader of a finished run (evaluation, serving, the lab,
    `model.init_from`) picks its checkpoint here."""
    return resolve(run_dir, "best") or resolve(run_dir, "last")


def find(run_dir: str | Path, which: str = "best") -> Path:
    """Checkpoint `which` ("best", falling back to last, or "last") of a run, or `run_dir` itself
    when it is a checkpoint folder; CheckpointError naming what was looked for otherwise."""
    folder = best_or_last(run_dir) if which == "best" else resolve(run_dir, which)
    if folder is not None:
        return folder
    if (Path(run_dir) / MANIFEST).exists():  # a checkpoint folder itself
        return Path(run_dir)
    if not Path(run_dir).exists():
        raise CheckpointError(f"{run_dir} does not exist: give a run folder of `attnlab train`")
    looked = "best/ and last/" if which == "best" else f"{which}/"
    subfolders = sorted(p.name for p in Path(run_dir).iterdir() if ckpt_folder(p))
    hint = (  # a lab folder holds runs: name one of them
        f"; it holds the runs {', '.join(subfolders[:4])}{' ...' if len(subfolders) > 4 else ''}"
        f": give one of them, e.g. {Path(run_dir) / subfolders[0]}"
        if subfolders
        else ""
    )
    raise CheckpointError(f"no checkpoint in {run_dir} (looked for {looked}){hint}")


def ckpt_folder(path: Path) -> bool:
    """Whether `path` is a run folder holding a checkpoint."""
    return path.is_dir() and any((path / n / MANIFEST).exists() for n in ("best", "last"))


def save(
    run_dir: str | Path,
    name: str,
    model: torch.nn.Module,
    model_config: ModelConfig,
    recipe: dict[str, Any],
    state: dict[str, Any],
    extra_files: dict[str, bytes] | None = None,
) -> Path:
    """Write checkpoint `name` ("last", "best") into run_dir atomically; returns its folder."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with _writing(run_dir, name, state.get("step")) as tmp:
        save_model(model, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(model_config.to_dict(), indent=2) + "\n")
        (tmp / "recipe.json").write_text(json.dumps(recipe, indent=2) + "\n")
        with open(tmp / "state.pt", "wb") as f:  # a Python file: its OSError keeps the errno
            torch.save(state, f)
        for fname, data in (extra_files or {}).items():
            (tmp / fname).write_bytes(data)
        files = {}
        for path in sorted(tmp.iterdir()):
            _fsync(path)
            files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        manifest = {"format": FORMAT, "step": state.get("step"), "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _fsync(tmp / MANIFEST)
        _fsync(tmp)
    final = run_dir / name
    _swap(tmp, final)
    return final


@contextlib.contextmanager
def _writing(run_dir: Path, name: str, step: Any) -> Iterator[Path]:
    """A fresh temporary folder for checkpoint `name`; a write into it that fails removes it
    and becomes CheckpointWriteError (an OSError, or a library's error around one)."""
    tmp = _temp(run_dir, name)
    try:
        tmp.mkdir()
        yield tmp
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, Exception) and not isinstance(err, AttnlabError):
            raise _write_failed(run_dir, name, step, err) from err
        raise


def copy(run_dir: str | Path, src: str, dst: str) -> Path:
    """Atomically make checkpoint `dst` a copy of checkpoint `src` (e.g. last -> best)."""
    run_dir = Path(run_dir)
    source = resolve(run_dir, src)
    if source is None:
        raise CheckpointError(f"no checkpoint {src!r} in {run_dir}")
    with _writing(run_dir, dst, _step(source)) as tmp:
        tmp.rmdir()  # copytree makes it
        shutil.copytree(source, tmp)
        for path in tmp.iterdir():
            _fsync(path)
        _fsync(tmp)
    final = run_dir / dst
    _swap(tmp, final)
    return final


def verify(folder: str | Path) -> dict[str, Any]:
    """Check every file of a checkpoint folder against its manifest; returns the manifest."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    mpath = folder / MANIFEST
    if not mpath.exists():
        raise CheckpointError(
            f"{folder} has no {MANIFEST}: it is not a complete attnlab checkpoint (a write was "
            f"interrupted, or this is not a checkpoint folder)"
        )
    try:
        manifest = json.loads(mpath.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(
            f"{mpath} is corrupt ({excerpt(err)}): the checkpoint cannot be trusted"
        ) from None
    files = _manifest_files(folder, manifest)
    hint = "restore it from a copy, or resume from the other checkpoint (last / best)"
    for fname, meta in files.items():
        path = folder / fname
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing: {hint}")
        size = path.stat().st_size
        if size != meta["bytes"]:
            raise CheckpointError(
                f"checkpoint file {path} is truncated or altered: {size} bytes, the manifest "
                f"says {meta['bytes']}: {hint}"
            )
        digest = _sha256(path)
        if digest != meta["sha256"]:
            raise CheckpointError(
                f"checkpoint file {path} is corrupt: SHA-256 {digest[:16]}..., the manifest says "
                f"{meta['sha256'][:16]}...: {hint}"
            )
    return manifest


REQUIRED = ("model.safetensors", "config.json", "recipe.json", "state.pt")


def _manifest_files(folder: Path, manifest: Any) -> dict[str, dict[str, Any]]:
    """The manifest's file table, checked before any file is read: every file of the folder
    and every required one listed, each with its size and SHA-256, every name a plain file name
    inside the folder (an empty, partial or hand-edited manifest verifies nothing)."""
    bad = f"{folder / MANIFEST} is not a valid checkpoint manifest"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise CheckpointError(f"{bad}: it has no 'files' table: the checkpoint cannot be trusted")
    for fname, meta in files.items():
        if Path(fname).name != fname or fname in ("", ".", "..", MANIFEST):
            raise CheckpointError(
                f"{bad}: the file name {excerpt(fname, 80)!r} is not a plain name inside the "
                f"checkpoint folder: the checkpoint cannot be trusted"
            )
        sha = meta.get("sha256") if isinstance(meta, dict) else None
        size = meta.get("bytes") if isinstance(meta, dict) else None
        if not (isinstance(size, int) and size >= 0 and isinstance(sha, str) and len(sha) == 64):
            raise CheckpointError(
                f"{bad}: the entry of {fname} needs 'bytes' (its size) and 'sha256' (64 hex "
                f"digits): the checkpoint cannot be trusted"
            )
    present = {p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST}
    unlisted = sorted((present | set(REQUIRED)) - set(files))
    if unlisted:
        raise CheckpointError(
            f"{bad}: it does not list {', '.join(unlisted)}: a checkpoint's manifest lists every "
            f"file it holds; restore the checkpoint from a copy, or resume from the other one"
        )
    return files


def _read(folder: str | Path, name: str, what: str):
    return reading(
        Path(folder) / name,
        what,
        "the checkpoint is damaged: restore it from a copy, or resume from the other one",
    )


def load_config(folder: str | Path) -> ModelConfig:
    path = Path(folder) / "config.json"
    with _read(folder, "config.json", "the model config"):
        data = json.loads(path.read_text())
    try:
        return ModelConfig.from_dict(data)
    except ConfigError as err:
        raise CheckpointError(f"{path} holds no valid model config: {err}") from None


def load_recipe(folder: str | Path) -> dict[str, Any]:
    with _read(folder, "recipe.json", "the recipe"):
        data = json.loads((Path(folder) / "recipe.json").read_text())
    if not isinstance(data, dict):
        raise CheckpointError(f"{Path(folder) / 'recipe.json'} does not hold a recipe (a mapping)")
    return data


def load_weights(
    folder: str | Path, model: torch.nn.Module, *, allow_nonfinite: bool = False
) -> None:
    """The checkpoint's weights into `model`. NaN or infinite weights are refused (a model that
    diverged is not loaded silently); `allow_nonfinite=True` loads them, to debug one."""
    path = Path(folder) / "model.safetensors"
    with _read(folder, "model.safetensors", "the weights"):
        missing, unexpected = load_model(model, str(path), strict=False)
    if missing or unexpected:
        raise CheckpointError(
            f"weights in {folder} do not fit the model: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}"
        )
    if not allow_nonfinite:
        from ..interop.layouts import check_finite

        try:
            check_finite(model.state_dict(), str(path))
        except ValueError as err:
            raise CheckpointError(str(err)) from None


def load_state(folder: str | Path) -> dict[str, Any]:
    with _read(folder, "state.pt", "the training state"):
        return torch.load(Path(folder) / "state.pt", map_location="cpu", weights_only=True)


def rng_state() -> dict[str, Any]:
    """Torch's (CPU and CUDA) and Python's generator states, for state.pt: restoring them
    replays the same dropout masks."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load(folder: str | Path, verify_files: bool = True) -> tuple[torch.nn.Module, ModelConfig]:
    """A model rebuilt from a checkpoint folder (config + weights), after verifying it."""
    from ..build import build_model

    if verify_files:
        verify(folder)
    cfg = load_config(folder)
    model = build_model(cfg)
    load_weights(folder, model)
    return model, cfg
