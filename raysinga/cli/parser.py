"""The ``raysinga`` command line: its commands, their arguments and their help."""

from __future__ import annotations

import argparse


def _add_set(parser: argparse.ArgumentParser) -> None:
    """``--set key.path=value``, for every command that reads a job file."""
    parser.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override a job-file value, e.g. --set updater.lr=0.05 (repeatable; YAML values)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="raysinga",
        description="Distributed deep-learning training with SINGA's architecture on Ray.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    t = sub.add_parser(
        "train",
        help="train from a YAML job file",
        description="Train the model a YAML job file describes and report test accuracy.",
    )
    t.add_argument("config", metavar="CONFIG", help="YAML job file, e.g. examples/digits_mlp.yaml")
    _add_set(t)
    t.add_argument(
        "--local",
        action="store_true",
        help="train in this process without Ray (the exact single-process reference)",
    )
    t.add_argument(
        "--address",
        metavar="ADDR",
        default=None,
        help=(
            "Ray cluster to join (default: RAY_ADDRESS). Without either, Ray's own rule: where "
            "a `ray start` cluster runs on this machine the run joins it, else it starts an "
            "embedded local Ray; 'local': the embedded one even then. The run prints which "
            "it did"
        ),
    )
    t.add_argument(
        "--no-ship",
        action="store_true",
        help="on a cluster joined, use the raysinga installed on every node instead of "
        "handing the roles this one's code",
    )
    t.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="CKPT",
        help="continue the run from its newest valid checkpoint (an error if there is none); "
        "with CKPT, one of the run's step-N checkpoints, from that one (the newer ones are "
        "moved aside)",
    )
    t.add_argument(
        "--auto-resume",
        action="store_true",
        help="continue from the newest valid checkpoint if there is one, else start",
    )
    t.add_argument(
        "--init-from",
        metavar="CKPT",
        default=None,
        help="start a new run from another checkpoint's parameters, matched by name "
        "(fine-tuning); prints what matched",
    )
    t.add_argument(
        "--rename",
        action="append",
        default=[],
        metavar="OLD=NEW",
        help="with --init-from: the checkpoint's name OLD is this model's NEW (OLD ending in "
        "'/' renames every name it starts); repeatable, added to the job file's init.rename",
    )
    t.add_argument(
        "--strip-prefix",
        metavar="PREFIX",
        default=None,
        help="with --init-from: removed from the front of each checkpoint name before renames",
    )
    t.add_argument(
        "--fresh",
        action="store_true",
        help="delete the run's existing checkpoints and start over",
    )

    i = sub.add_parser(
        "inspect",
        help="show a checkpoint's manifest and parameter table",
        description="Show a checkpoint's manifest and its parameter table "
        "(sizes are checked; use `verify` for checksums).",
    )
    i.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or URI (step-N)")
    i.add_argument("--json", action="store_true", help="machine-readable output")

    v = sub.add_parser(
        "verify",
        help="check a checkpoint's sizes and checksums",
        description="Check every file's size and checksum and every tensor's "
        "checksum; exit 0 when the checkpoint is intact, 1 otherwise.",
    )
    v.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or URI (step-N)")
    v.add_argument("--fast", action="store_true", help="check sizes only, no hashing")

    e = sub.add_parser(
        "export",
        help="write a checkpoint's merged tensors to safetensors or npz",
        description="Write whole (merged) tensors of a checkpoint to one file.",
    )
    e.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or URI (step-N)")
    e.add_argument(
        "--format",
        choices=("safetensors", "npz", "torch"),
        required=True,
        help="torch: a PyTorch state_dict with PyTorch's names and layouts (needs PyTorch)",
    )
    e.add_argument("-o", "--output", required=True, metavar="FILE", help="file to write")
    e.add_argument(
        "--kind",
        choices=("param", "slot", "state", "all"),
        default="param",
        help="which tensors (default: trainable parameters)",
    )

    pl = sub.add_parser(
        "plot",
        help="draw a run's loss, accuracy and throughput as PNGs",
        description="Draw loss and test accuracy against step (loss.png) and samples/s "
        "(throughput.png) from a run's metrics.jsonl, with checkpoints, failures and resizes "
        "marked. Needs matplotlib (pip install 'raysinga[plot]').",
    )
    pl.add_argument(
        "run",
        metavar="RUN",
        help="run directory (holding metrics.jsonl), the file, or a checkpoint directory's URI "
        "(its record/, where a run with checkpoints in shared storage copies metrics.jsonl)",
    )
    pl.add_argument(
        "-o",
        "--output",
        metavar="DIR",
        default=None,
        help="where to write (default: RUN; for a URI, the current directory)",
    )

    gen = sub.add_parser(
        "generate",
        help="sample text from a checkpoint of a character-level language model",
        description="Continue PROMPT with characters drawn from the model of CHECKPOINT (a run "
        "on the text corpus, e.g. examples/charlm.yaml or examples/chargru.yaml).",
    )
    gen.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint or a run directory")
    gen.add_argument("--prompt", default="def ", help="the text to continue (default: 'def ')")
    gen.add_argument("--length", type=int, default=300, help="characters to add (default 300)")
    gen.add_argument(
        "--temperature", type=float, default=0.8, help="0: the likeliest; higher: more varied"
    )
    gen.add_argument("--seed", type=int, default=0, help="the sampling generator's seed")

    r = sub.add_parser(
        "runs",
        help="list runs and their checkpoints, or the object-store registry's entries",
        description="List the runs under DIR (each run directory with checkpoints: how many, "
        "the newest valid one, their size, what was set aside), or with --registry the "
        "entries of the cluster's object-store checkpoint registry; --drop removes entries.",
    )
    r.add_argument("dir", metavar="DIR", nargs="?", default="runs", help="default: runs")
    r.add_argument(
        "--registry",
        action="store_true",
        help="the registry of the cluster in --address / RAY_ADDRESS (or run by `ray start` "
        "here) instead",
    )
    r.add_argument("--address", default=None, help="Ray cluster of the registry")
    r.add_argument(
        "--drop",
        metavar="RUN_KEY",
        default=None,
        help="with --registry: drop this run's entries (key as listed: NAME@CHECKPOINT_DIR)",
    )
    r.add_argument("--step", type=int, default=None, help="with --drop: only this step")
    r.add_argument("--json", action="store_true", help="machine-readable output")

    st = sub.add_parser(
        "status",
        help="one screen of a live run: its roles, their nodes and states, checkpoint, recoveries",
        description="Show what the driver of a run on Ray last wrote of it (its status.json, "
        "updated at every report, state change, loss, recovery and checkpoint): its driver's "
        "pid and host, shown dead where that process is gone (on its host) or silent where its "
        "reports are long overdue; each role with its node, its pid, its state (stepping, "
        "recovering, spare) and last step time; the latest checkpoint; the recoveries so far. "
        "With --address, the run of that name on a live "
        "Ray cluster, from any machine that reaches it (the driver puts the same into the "
        "cluster's key-value store).",
    )
    st.add_argument(
        "run",
        metavar="RUN",
        help="the run directory, or a run's name (runs/NAME; with --address, the job's name)",
    )
    st.add_argument(
        "--address",
        metavar="HOST:PORT",
        default=None,
        help="the Ray cluster the run is on (its GCS address, as `ray start --head` printed)",
    )
    st.add_argument("--json", action="store_true", help="the same, machine-readable")

    g = sub.add_parser(
        "graph",
        help="write a job's net structure as JSON and draw it (PNG or SVG)",
        description="Write the net of a YAML job file as JSON (every layer with its options, "
        "output shape and parameters) and draw the layer chain (drawing needs matplotlib; "
        "-o NAME.json writes the JSON alone).",
    )
    g.add_argument("config", metavar="CONFIG", help="YAML job file")
    g.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        default=None,
        help="the drawing, .png or .svg (default: <name>-net.png), the JSON beside it; "
        "or .json: the JSON alone",
    )
    _add_set(g)
    _add_tune(sub)
    return p


def _add_tune(sub: argparse._SubParsersAction) -> None:
    tu = sub.add_parser(
        "tune",
        help="search a job's hyperparameters with Ray Tune (PBT, ASHA, PB2 or FIFO)",
        description="Run trials of a job with Ray Tune, each a run whose hyperparameters "
        "(dotted job keys) the --search expressions sample, and print a table of the trials "
        "and the best. --replay runs one trial's lineage again and compares it with the trial; "
        "--release drops a search's checkpoints from the cluster's object store.",
    )
    tu.add_argument("config", metavar="CONFIG", help="YAML job file")
    tu.add_argument(
        "--search",
        metavar="KEY=SAMPLER(ARGS)",
        action="append",
        default=[],
        help="a searched job key: loguniform(a,b), uniform(a,b), randint(a,b) (b exclusive), "
        "choice(v1,v2,...) or grid(v1,v2,...), e.g. 'updater.lr=loguniform(1e-4,1e-1)' "
        "(repeatable)",
    )
    tu.add_argument(
        "--scheduler",
        choices=("pbt", "asha", "pb2", "fifo"),
        default="fifo",
        help="pbt: population-based training, its mutations the searched keys; asha: stops "
        "poor trials early; pb2: PBT with a bandit (needs GPy, scikit-learn; ranges only); "
        "fifo: every trial to the end (default)",
    )
    tu.add_argument(
        "--trials",
        type=int,
        default=4,
        help="samples of the search space (default 4; a grid runs this many times over)",
    )
    tu.add_argument(
        "--metric",
        default=None,
        help="what is optimized (default: valid_loss where the job has data.validation, else "
        "test_loss)",
    )
    tu.add_argument(
        "--mode",
        choices=("min", "max"),
        default=None,
        help="default: min for losses, max for accuracies",
    )
    tu.add_argument(
        "--report-every",
        type=int,
        metavar="N",
        default=None,
        help="steps between reports, each with an evaluation and a checkpoint (default: the "
        "job's checkpoint_frequency, else test_freq, else a tenth of the run)",
    )
    tu.add_argument(
        "--perturbation-interval",
        type=int,
        metavar="K",
        default=None,
        help="pbt, pb2: reports between exploits (default: a quarter of the reports, at least 1)",
    )
    tu.add_argument(
        "--synch",
        action="store_true",
        help="pbt, pb2: every trial waits at each perturbation point for the others, so the "
        "worst exploit the best of the same report, not whoever reported last",
    )
    tu.add_argument(
        "--keep",
        type=int,
        metavar="N",
        default=2,
        help="each trial's newest checkpoints held in Ray's object store (default 2)",
    )
    tu.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        default=None,
        help="also keep every trial's checkpoints here (a path or URI): the copy read where an "
        "object is lost with its node",
    )
    tu.add_argument(
        "--handover",
        choices=("object_store", "tune_storage"),
        default="object_store",
        help="how an exploit hands a checkpoint over: through Ray's object store (default), or "
        "as Tune's own checkpoint directory in --storage",
    )
    _add_set(tu)
    tu.add_argument(
        "--storage",
        metavar="DIR",
        default="runs/tune",
        help="Tune's storage path (default: runs/tune); the search is NAME under it",
    )
    tu.add_argument("--name", default=None, help="the search's name (default: JOB-tune-TIME)")
    tu.add_argument(
        "--address", metavar="ADDR", default=None, help="Ray cluster to join, as train takes it"
    )
    tu.add_argument("--quiet", action="store_true", help="without Tune's progress tables")
    tu.add_argument(
        "--replay",
        metavar="TRIAL",
        default=None,
        help="instead of searching: run the lineage of TRIAL (a trial directory: its final "
        "Tune checkpoint; or a checkpoint_* directory) again here, and compare the parameters "
        "with the trial's where its checkpoint is still held",
    )
    tu.add_argument(
        "--until",
        type=int,
        metavar="STEP",
        default=None,
        help="with --replay: stop at STEP (default: the checkpoint's step)",
    )
    tu.add_argument(
        "--release",
        action="store_true",
        help="instead of searching: drop search --name's checkpoints from the object store of "
        "the cluster (--address)",
    )
