"""The ``raysinga`` command line.

Errors a user can fix (a bad job file, a missing data set) print one line naming the problem and
exit with status 2; nothing else of the library imports this module.
"""

from __future__ import annotations

import argparse
import os
import re
import select
import signal
import sys
import threading
from pathlib import Path

from raysinga import config as config_mod
from raysinga.checkpoint.format import MANIFEST, CheckpointError
from raysinga.checkpoint.storage import redact_text

from . import runs
from .parser import build_parser

EXPORT_SUFFIX = {"npz": ".npz", "safetensors": ".safetensors", "torch": ".pt"}


def _warn(message: str) -> None:
    print(f"raysinga: warning: {message}", file=sys.stderr)


def _dir_usable(path: Path, name: str) -> None:
    """``path`` is, or can be made, a directory: refuse one that is a file or lies below one."""
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                below = "" if p == path else f" lies below {p}, which"
                raise ValueError(f"{name}: {path}{below} is a file, not a directory")
            return


def _checkpoint_arg(where: str) -> str:
    """A local checkpoint argument that plainly is not one gets a message saying what it is."""
    p = Path(where)
    if "://" in where or (p / MANIFEST).exists():
        return where
    if p.is_file():
        raise CheckpointError(f"{where}: a file, not a checkpoint (a step-N directory)")
    from raysinga.checkpoint.manage import latest  # noqa: PLC0415 - pyarrow, only where needed

    for root in (p, p / "checkpoints"):
        if not any(re.fullmatch(r"step-\d+", q.name) for q in root.glob("step-*") if q.is_dir()):
            continue
        found = latest(str(root), verify="fast")  # sizes only: a directory listing's worth
        newer = "".join(f"; newer {Path(d).name} is not valid ({why})" for d, why in found.skipped)
        if found.checkpoint is None:
            raise CheckpointError(
                f"{where}: not a checkpoint, and none of its step-N is valid{newer}"
            )
        raise CheckpointError(
            f"{where}: not a checkpoint but holds some; the newest valid is "
            f"{root / f'step-{found.checkpoint.step}'}{newer}"
        )
    return where


def _check_train(cfg: config_mod.JobConfig, args: argparse.Namespace) -> None:
    """Settings this run cannot use are warned about; paths it cannot write are refused."""
    from raysinga.data import has_split  # noqa: PLC0415

    if (cfg.topology is None or args.local) and cfg.raw.get("fault"):
        _warn("fault.* applies to distributed runs; ignored")
    if cfg.topology is None and args.address:
        _warn("--address applies to distributed runs and this job has no topology; ignored")
    if cfg.test_freq and not has_split(cfg.data.source, "test") and not cfg.data.validation:
        _warn(
            f"test_freq: data.source (kind {cfg.data.source['kind']}) has no 'test' entry, so "
            "there is no test split and nothing is evaluated"
        )
    _dir_usable(Path(cfg.run_path), "run_dir")
    if cfg.checkpoint.dir is not None and "://" not in cfg.checkpoint.dir:
        _dir_usable(Path(cfg.checkpoint.dir), "checkpoint.dir")


def _with_init_names(cfg: config_mod.JobConfig, args: argparse.Namespace) -> config_mod.JobConfig:
    """``--rename`` and ``--strip-prefix`` added to the job file's ``init`` section."""
    if not (args.rename or args.strip_prefix):
        return cfg
    if not args.init_from:
        raise ValueError("--rename and --strip-prefix go with --init-from")
    rename = dict(cfg.init.rename)
    for pair in args.rename:
        old, eq, new = pair.partition("=")
        if not eq:
            raise ValueError(f"--rename {pair}: expected OLD=NEW")
        rename[old] = new
    strip = args.strip_prefix or cfg.init.strip_prefix
    section = {"rename": rename, "strip_prefix": strip}
    raw = {**cfg.raw, "init": section}  # the job as run, kept in its record and checkpoints
    return config_mod.from_dict(raw)


def _train(args: argparse.Namespace) -> int:
    if args.address and args.local:
        raise ValueError("--address and --local exclude one another (--local trains without Ray)")
    chosen = [
        flag
        for flag, on in (
            ("--resume", args.resume),
            ("--auto-resume", args.auto_resume),
            ("--init-from", args.init_from),
            ("--fresh", args.fresh),
        )
        if on
    ]
    if len(chosen) > 1:
        raise ValueError(
            f"{' and '.join(chosen)} were given together: --resume, --auto-resume, "
            "--init-from and --fresh exclude one another"
        )
    if isinstance(args.resume, str) and "://" not in args.resume:
        args.resume = str(Path(args.resume).resolve())  # a path, never the word "auto"
    start = {
        "resume": "auto" if args.auto_resume else args.resume,
        "init_from": args.init_from,
        "fresh": args.fresh,
    }
    cfg = _with_init_names(config_mod.load(args.config, args.set), args)
    _check_train(cfg, args)
    if args.init_from and args.init_from.endswith((".pt", ".pth")):  # PyTorch's state_dict
        from raysinga.nn.torch_interop import as_checkpoint  # noqa: PLC0415

        where = Path(cfg.run_path) / "from-torch"
        start["init_from"] = str(as_checkpoint(args.init_from, cfg, where))
    elif args.init_from:
        _checkpoint_arg(args.init_from)
    from raysinga.obs.progress import Progress  # noqa: PLC0415
    from raysinga.run.session import Preempted  # noqa: PLC0415

    log = Progress()  # a bar on a terminal, plain lines elsewhere: the run's events as text
    try:
        if cfg.topology is None or args.local:
            from raysinga.run.trainer import Trainer  # noqa: PLC0415 - keeps `raysinga --help` fast

            result = Trainer(cfg, log=None, on_event=log, **start).fit()
        else:
            from raysinga.distributed.trainer import DistributedTrainer  # noqa: PLC0415 - imports Ray

            result = DistributedTrainer(
                cfg,
                log=None,
                on_event=log,
                address=args.address,
                gather=False,
                ship=not args.no_ship,
                **start,
            ).fit()
    except Preempted as e:
        log.close()
        print(f"raysinga: {e}", file=sys.stderr)
        return 128 + e.signum
    except SystemExit as e:
        # Ray's own SIGTERM handler (it raises SystemExit(15)), which holds outside the
        # training steps: while joining the cluster, taking the run's lock, or ending the run.
        if e.code != signal.SIGTERM:
            raise
        log.close()
        print(
            "raysinga: stopped by SIGTERM outside the training steps (while the run was starting "
            "or ending); its committed checkpoints are intact",
            file=sys.stderr,
        )
        return 128 + signal.SIGTERM
    finally:
        log.close()
        if args.own_process:
            _ignore_late_sigterm()
    final = result.final_eval
    if final is not None and "test_bits" in final:
        print(_final_bits(cfg.data.source, final["test_bits"]))
    elif final is not None and "test_accuracy" in final:
        print(f"final test accuracy: {final['test_accuracy']:.4f}")
    if result.best is not None:
        b = result.best
        where = redact_text(b["path"])
        print(f"best checkpoint by {b['metric']} ({b['value']:.4f}): step {b['step']}, {where}")
    return 0


def _final_bits(source: dict, got: float) -> str:
    """A language model's final validation loss in bits, beside what the characters' own
    frequencies give (the text corpus only: its tokens are characters)."""
    if source.get("kind") != "text":
        return f"final validation loss: {got:.3f} bits per token"
    from raysinga.data import load_dataset  # noqa: PLC0415
    from raysinga.data.text import unigram_bits  # noqa: PLC0415

    base = unigram_bits(load_dataset(source, "train"), load_dataset(source, "test"))
    return (
        f"final validation loss: {got:.3f} bits per character; unigram baseline "
        f"{base:.3f} ({got / base:.2f}x)"
    )


def _ignore_late_sigterm() -> None:
    """The run has ended and the process is about to: a SIGTERM now (``ray job stop`` of a job
    in its last moment) must not cut short its report or Ray's shutdown with a traceback."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _inspect(args: argparse.Namespace) -> int:
    import json  # noqa: PLC0415

    from raysinga.checkpoint import Checkpoint  # noqa: PLC0415

    ck = Checkpoint.open(_checkpoint_arg(args.checkpoint), verify="fast")
    rows: dict[str, dict] = {}
    for i in ck.infos:
        r = rows.setdefault(
            i.name,
            {
                "name": i.name,
                "kind": i.kind,
                "shape": list(i.shape),
                "dtype": i.dtype,
                "version": i.version,
                "slices": 0,
                "shards": [],
            },
        )
        r["slices"] += 1
        r["shards"].append(i.shard)
    if args.json:
        print(
            json.dumps(
                {
                    "path": str(ck.location),
                    "step": ck.step,
                    "format_version": ck.manifest["version"],
                    "meta": ck.meta,
                    "files": ck.manifest["files"],
                    "tensors": list(rows.values()),
                },
                indent=2,
                default=str,
            )
        )
        return 0
    m = ck.manifest
    total = sum(f["size"] for f in m["files"])
    print(
        f"checkpoint {ck.location}\n  format version {m['version']}, step {ck.step}, "
        f"{len(m['files'])} files, {total:,} bytes"
    )
    for k, v in ck.meta.items():
        print(f"  {k}: {json.dumps(v, default=str)[:120]}")
    from raysinga.nn.usercode import inspect_line  # noqa: PLC0415

    own = inspect_line(ck.meta.get("run") or {})
    if own:
        print(f"  layers and losses of the user's own: {own}")
    w = max([len(n) for n in rows] + [4])
    print(f"\n  {'name':<{w}}  {'kind':<5}  {'shape':<16}  {'dtype':<8}  version  slices  shards")
    for r in rows.values():
        shape = "x".join(map(str, r["shape"])) or "scalar"
        shards = ",".join(map(str, sorted(set(r["shards"]))))
        print(
            f"  {r['name']:<{w}}  {r['kind']:<5}  {shape:<16}  {r['dtype']:<8}  "
            f"{r['version']:>7}  {r['slices']:>6}  {shards}"
        )
    return 0


def _verify(args: argparse.Namespace) -> int:
    from raysinga.checkpoint import Checkpoint  # noqa: PLC0415

    ck = Checkpoint.open(_checkpoint_arg(args.checkpoint), verify="fast" if args.fast else "full")
    n = 0 if args.fast else ck.verify_tensors()
    how = "sizes checked" if args.fast else f"{n:,} tensor bytes and every file hash checked"
    print(f"ok: {ck.location}: step {ck.step}, {len(ck.infos)} tensor slices, {how}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from raysinga.checkpoint import Checkpoint, export  # noqa: PLC0415

    out, suffix = Path(args.output), EXPORT_SUFFIX[args.format]
    if out.is_dir():
        raise ValueError(
            f"{out}: a directory; -o names the file to write, e.g. {out / 'model'}{suffix}"
        )
    if out.suffix != suffix:
        raise ValueError(f"{out}: --format {args.format} writes a {suffix} file; name it so")
    if not out.parent.is_dir():
        raise ValueError(f"{out.parent}: no such directory (for -o {out})")
    ck = Checkpoint.open(_checkpoint_arg(args.checkpoint))
    if args.format == "torch":
        from raysinga.nn.torch_interop import export as export_torch  # noqa: PLC0415

        names = export_torch(ck, args.output)
    else:
        names = export(ck, args.output, args.format, None if args.kind == "all" else args.kind)
    print(f"wrote {len(names)} tensors of step {ck.step} to {args.output} ({args.format})")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from raysinga.obs.plots import plot_run  # noqa: PLC0415

    if args.output is not None:
        _dir_usable(Path(args.output), "-o")
    run = args.run
    if "://" in run:  # a record beside checkpoints in shared storage: plotted here
        from raysinga.run.record import fetch_metrics  # noqa: PLC0415

        run = str(fetch_metrics(run, Path(args.output or ".")))
    for path in plot_run(run, args.output):
        print(f"wrote {path}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from raysinga.checkpoint import Checkpoint  # noqa: PLC0415
    from raysinga.run.generate import generate  # noqa: PLC0415

    ck = Checkpoint.open(_checkpoint_arg(args.checkpoint))
    print(generate(ck, args.prompt, args.length, args.temperature, args.seed))
    return 0


def _graph(args: argparse.Namespace) -> int:
    from raysinga.obs.graph import write_graph  # noqa: PLC0415

    if args.output is not None:
        _dir_usable(Path(args.output).parent, "-o")
    for path in write_graph(config_mod.load(args.config, args.set), args.output):
        print(f"wrote {path}")
    return 0


def _tune(args: argparse.Namespace) -> int:
    from .tune import run  # noqa: PLC0415 - Ray Tune, only where needed

    return run(args)


def program() -> None:
    """The ``raysinga`` command: :func:`main` as the process itself, ended with its status."""
    sys.exit(main(own_process=True))


def main(argv: list[str] | None = None, own_process: bool = False) -> int:
    """Run the command ``argv`` (default: the process's arguments) and return its exit status.
    ``own_process``: the process ends after it (it may then set process-wide signal handling)."""
    args = build_parser().parse_args(argv)
    args.own_process = own_process
    commands = {
        "train": _train,
        "inspect": _inspect,
        "verify": _verify,
        "export": _export,
        "plot": _plot,
        "generate": _generate,
        "graph": _graph,
        "runs": runs.listing,
        "status": runs.status,
        "tune": _tune,
    }
    try:
        status = commands[args.command](args)
        sys.stdout.flush()  # a reader gone (`| head -1`) is met here, not at the exit
        return status
    except BrokenPipeError:  # stdout's reader gone, or a pipe of the code's own: a bug
        return _reader_gone(own_process) if _stdout_closed() else _internal_error()
    except (config_mod.ConfigError, ValueError) as e:
        _error(e)
        return 2
    except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as e:
        # a path the user gave (or the run's directories) that cannot be read or written
        where = f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e)
        _error(where)
        return 2
    except CheckpointError as e:
        _error(e)
        return 1
    except (RuntimeError, FloatingPointError) as e:  # a role failed, the cluster cannot hold
        # the topology, or the loss went non-finite
        _error(e)
        return 1
    except KeyboardInterrupt:
        print("raysinga: interrupted", file=sys.stderr)
        return 130
    except Exception:  # noqa: BLE001 - not the user's input: ours to fix
        return _internal_error()


def _internal_error() -> int:
    """The exception being handled, as a bug: its traceback and one line that says so."""
    import traceback  # noqa: PLC0415

    print(redact_text(traceback.format_exc()), end="", file=sys.stderr)
    print(
        "raysinga: internal error: the traceback above is a bug in raysinga, not a mistake "
        "in your input; please report it with the command you ran",
        file=sys.stderr,
    )
    return 70


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll reports an error on its end)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll, or a stdout without a descriptor
        return False


def _reader_gone(own_process: bool) -> int:
    """A closed pipe on stdout (``raysinga status RUN | head -1``) ends the command quietly,
    with the status of a Unix tool that SIGPIPE ended (128 + 13)."""
    if own_process:  # what stdout still buffers would fail again at the exit, with a message
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def _error(what: object) -> None:
    """The one line an error gets, with any credentials in a URI it names left out."""
    print(f"raysinga: error: {redact_text(str(what))}", file=sys.stderr)
