"""``python -m kombu_pgqueue migrate|version|sql``: schema management without Celery."""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import NoReturn

import psycopg

from . import _sql, migrations
from ._options import DEFAULT_SCHEMA, mask
from .exceptions import PgQueueError

#: libpq's variables that name a server or a database (PGUSER or PGPORT alone still
#: leave libpq to guess: the local socket, a database named as the user)
_LIBPQ_TARGET = ("PGHOST", "PGHOSTADDR", "PGDATABASE", "PGSERVICE")


class _Parser(argparse.ArgumentParser):
    """argparse, minus the echo of a password in its usage errors."""

    def error(self, message: str) -> NoReturn:
        message = re.sub(r"(://[^:/@\s]*:)[^@\s]*@", r"\1**@", message)
        message = re.sub(r"(password\s*=\s*)\S+", r"\1**", message)
        super().error(message)


def main(argv: list[str] | None = None) -> int:
    # --dsn and --schema go before or after the command: `migrate --dsn ...` as the
    # error messages print it, and `--dsn ... migrate` as well
    common = _Parser(add_help=False)
    common.add_argument(
        "--dsn",
        default=argparse.SUPPRESS,
        help=(
            "libpq connection string or URL (default: $PGQUEUE_DSN, then libpq's PG* "
            "variables; migrate needs one of the three)"
        ),
    )
    common.add_argument(
        "--schema", default=argparse.SUPPRESS, help="broker schema (default: pgqueue)"
    )
    parser = _Parser(prog="python -m kombu_pgqueue", parents=[common])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("migrate", parents=[common], help="install or upgrade the broker schema")
    versions = sub.add_parser(
        "version", parents=[common], help="print the schema's version against the code's"
    )
    versions.add_argument(
        "--check", action="store_true", help="exit 1 unless the schema is the code's version"
    )
    sub.add_parser(
        "sql", parents=[common], help="print the migrations' SQL for the schema, to apply by hand"
    )
    args = parser.parse_args(argv)
    args.dsn = getattr(args, "dsn", os.environ.get("PGQUEUE_DSN", ""))
    args.schema = getattr(args, "schema", DEFAULT_SCHEMA)
    if args.dsn.startswith("pgqueue"):  # a broker URL, as in Celery's broker_url
        from .admin import conninfo

        args.dsn = conninfo(args.dsn)

    if args.command == "migrate" and not args.dsn and not any(map(os.getenv, _LIBPQ_TARGET)):
        print(
            "name the database to migrate: --dsn, $PGQUEUE_DSN or libpq's PGHOST, "
            "PGHOSTADDR, PGDATABASE or PGSERVICE "
            "(without any, libpq would connect to its default database, on this machine's "
            "socket, as this user)",
            file=sys.stderr,
        )
        return 2
    try:
        with psycopg.connect(args.dsn, autocommit=True) as conn:
            if args.command == "sql":
                for version, slug, text in _sql.migration_files():
                    print(f"-- {version:04d}_{slug}")
                    print(_sql.compose(text, args.schema).as_string(conn))
                return 0
            info = conn.info
            where = f"schema {args.schema!r} in database {info.dbname!r} on {info.host}:{info.port}"
            if args.command == "migrate":
                applied = migrations.migrate(conn, args.schema)
                done = ", ".join(map(str, applied)) or "nothing (already current)"
                print(f"{where} as {info.user}: applied {done}")
            else:
                have = migrations.current_version(conn, args.schema)
                print(f"{where}: {migrations.describe(have, 'python -m kombu_pgqueue migrate')}")
                return 1 if args.check and have != migrations.latest_version() else 0
    except psycopg.errors.ReadOnlySqlTransaction as exc:
        print(
            f"{mask(args.dsn) or 'the default database'} is read-only ({exc.diag.message_primary}):"
            " a standby, or default_transaction_read_only is on. Migrations run on the"
            " primary only; point --dsn at it.",
            file=sys.stderr,
        )
        return 2
    except psycopg.OperationalError as exc:
        reason = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(
            f"cannot connect to {mask(args.dsn) or 'the default database'}: {reason}",
            file=sys.stderr,
        )
        return 2
    except PgQueueError as exc:
        print(str(exc), file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
