"""python -m cluster: the local twin and raywright's jobs on a Ray cluster.

    python -m cluster up --local | down --local
    python -m cluster submit {train,tune,serve} --config FILE [--set K=V ...] [--env K=V ...] [--follow]
    python -m cluster logs JOB_ID [--follow]  |  status JOB_ID  |  stop JOB_ID  |  list
--follow ends with the job's status (exit code 1 where it failed); Ctrl-C stops following, not the job.
Every job command takes --address (default: RAY_ADDRESS if http(s), else http://127.0.0.1:8265).
"""

import argparse
import asyncio
import re
import sys

from ray.job_submission import JobStatus, JobSubmissionClient

from cluster.jobs import DEFAULT_ADDRESS, KINDS, JobError, connect, job_address, submit
from train.cli import OneLineParser, one_line_errors, take_sigterm_as_ctrl_c
from train.schema import ConfigError


def _pairs(items: list[str], option: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{option} {item!r} must look like KEY=VALUE")
        pairs[key] = value
    return pairs


def _follow(client: JobSubmissionClient, job_id: str) -> int:
    """Stream the job's logs until it ends, then say how it ended; 1 where it failed (as ``ray job submit``).
    Ctrl-C or SIGTERM stops following, not the job."""

    async def tail() -> None:
        async for lines in client.tail_job_logs(job_id):
            print(lines, end="", flush=True)

    take_sigterm_as_ctrl_c()
    try:
        asyncio.run(tail())
    except KeyboardInterrupt:
        raise KeyboardInterrupt(
            f"stopped following {job_id}, which goes on (python -m cluster stop {job_id} stops it)"
        ) from None
    return 1 if _print_status(client, job_id) == JobStatus.FAILED else 0


def _print_status(client: JobSubmissionClient, job_id: str) -> JobStatus:
    info = client.get_job_info(job_id)
    # A failed job's message goes on with the end of its logs, which `logs JOB` shows: its first line is enough.
    message = re.sub(r",? ?last available logs.*", "", (info.message or "").split("\n")[0])
    print(f"{job_id}: {info.status.value}" + (f" ({message})" if message else ""), flush=True)
    return info.status


def _parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m cluster", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    # Every job command talks to a cluster's job API.
    on_cluster = OneLineParser(add_help=False)
    on_cluster.add_argument(
        "--address",
        help=f"the cluster's job API URL (default: $RAY_ADDRESS if it is a URL, else {DEFAULT_ADDRESS}, "
        "where `ray dashboard cluster.yaml` tunnels it)",
    )
    for name in ("up", "down"):
        twin = commands.add_parser(name, help=f"{'start' if name == 'up' else 'stop'} the local twin")
        twin.add_argument("--local", action="store_true", required=True, help="the fake_multinode twin on this machine")
    run = commands.add_parser(
        "submit",
        parents=[on_cluster],
        help="submit a train, tune or serve job",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="--config and --set are those of the job's own command:\n"
        "python -m train --help, python -m tune --help and python -m serve --help list every setting.",
    )
    run.add_argument("kind", choices=KINDS)
    run.add_argument("--config", required=True, help="shipped recipe or sweep name, or a YAML file in this project")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    run.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment of the job")
    run.add_argument("--follow", action="store_true", help="stream the job's logs until it ends")
    for name, what in (
        ("logs", "one job's logs"),
        ("status", "one job's status"),
        ("stop", "stop one job: SIGTERM, which a training run or a sweep takes as Ctrl-C"),
    ):
        job = commands.add_parser(name, parents=[on_cluster], help=what)
        job.add_argument("job_id")
        if name == "logs":
            job.add_argument("--follow", action="store_true", help="stream the job's logs until it ends")
    commands.add_parser("list", parents=[on_cluster], help="the cluster's jobs")
    return parser


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command in ("up", "down"):
            from cluster import local

            if args.command == "up":
                state = local.up()
                print(f"local twin up: Ray at {state.address}, job API at {state.dashboard}")
                print(f"export RAY_ADDRESS={state.dashboard}")
            else:
                print(f"local twin down ({local.down()} processes stopped)")
            return 0
        if args.command == "submit":
            job_id = submit(args.kind, args.config, args.set, args.address, _pairs(args.env, "--env"))
            print(f"submitted {job_id} to {job_address(args.address)}", flush=True)
            if args.follow:
                return _follow(connect(args.address), job_id)
            at = f" --address {args.address}" if args.address else ""
            print(f"follow it: python -m cluster logs {job_id} --follow{at}")
            print(f"stop it:   python -m cluster stop {job_id}{at}")
            return 0
        client = connect(args.address)
        if args.command == "list":
            for job in client.list_jobs():
                print(f"{job.submission_id}  {job.status.value:<9}  {job.entrypoint}")
        elif args.command == "status":
            _print_status(client, args.job_id)
        elif args.command == "stop":
            if client.stop_job(args.job_id):
                print(f"stop requested for {args.job_id}")
            else:
                print(f"nothing to stop: {args.job_id} has ended")
                _print_status(client, args.job_id)
        elif args.follow:
            return _follow(client, args.job_id)
        else:
            print(client.get_job_logs(args.job_id), end="")
        return 0
    except (JobError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
