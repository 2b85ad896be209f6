"""Naming what is wrong with a checkpoint mirror: the launch's probe (list, then write and delete
a small object, so a missing bucket or an unwritable mirror is an error at launch and never an
empty mirror), the real cause of a failed operation (the exception's own class and message),
the fix for it, and retries of transport errors. Torch-free."""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from m3run.runner.supervisor.mirror import Mirror, MirrorError, RemoteCheckpoint

log = logging.getLogger(__name__)

PROBE_PREFIX = ".m3run-probe-"  # the object the probe writes and deletes at the mirror's root
# Errors that another attempt cannot cure (a missing bucket, a file where a directory must be,
# refused credentials): reported at once. Anything else (a connection refused, a timeout, a
# throttled request) is retried.
DEFINITIVE = (
    FileNotFoundError,
    PermissionError,
    NotADirectoryError,
    FileExistsError,
    IsADirectoryError,
)


def cause(e: BaseException) -> str:
    """The real cause of a failed mirror operation: the exception's class and its own message
    (an OSError's errno by name when it has one)."""
    text = str(e) or repr(e)
    if isinstance(e, OSError) and e.errno and e.strerror:
        name = errno.errorcode.get(e.errno, str(e.errno))
        where = f": {e.filename}" if e.filename else ""
        text = f"{e.strerror} ({name}){where}"
    return f"{type(e).__name__}: {text}"


def fix_for(mirror: Mirror, e: BaseException) -> str:
    """What to do about error `e` of `mirror`, for messages."""
    if isinstance(e, FileNotFoundError) and not mirror.is_local:
        bucket = f"{mirror.scheme}://{mirror.root.split('/')[0]}"
        return (
            f"create the bucket {bucket} or correct the URL; the credentials in the "
            "environment must be able to see it"
        )
    if isinstance(e, PermissionError):
        return (
            "give the credentials in the environment the right to list, read, write and "
            f"delete under {mirror.url}, or use another URL"
        )
    if isinstance(e, (NotADirectoryError, FileExistsError)):
        return f"a path on the way to {mirror.root} is a file, not a directory: move it away"
    if isinstance(e, OSError) and e.errno in (errno.EROFS, errno.EACCES, errno.ENOSPC):
        return f"make {mirror.root} writable, with free space, or use another URL"
    return (
        "check that the store is reachable, and the endpoint and credentials in the "
        "environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, GOOGLE_APPLICATION_CREDENTIALS)"
    )


def retrying(fn: Callable[[], Any], attempts: int = 3, backoff_s: float = 1.0) -> Any:
    """`fn()`, tried again after a transport error, waiting `backoff_s` doubling. A MirrorError,
    a DEFINITIVE error and the last attempt's error are raised."""
    for attempt in range(attempts):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        try:
            return fn()
        except (MirrorError, *DEFINITIVE):
            raise
        except Exception as e:  # the backends' transport errors have no common base
            if attempt == attempts - 1:
                raise
            log.warning("mirror attempt %d/%d failed: %s", attempt + 1, attempts, cause(e))
    raise AssertionError("unreachable")


def probe(mirror: Mirror, attempts: int = 3, backoff_s: float = 1.0) -> list[RemoteCheckpoint]:
    """Check that `mirror` can be listed and written: list its checkpoints, then write and delete
    a small probe object at its root. Returns the listing. A MirrorError names the URL, the
    operation, the real cause and the fix; transport errors are retried first."""
    fs = mirror.fs
    name = f"{mirror.root}/{PROBE_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
    what = "listing it"

    def again(fn: Callable[[], Any]) -> Any:
        return retrying(fn, attempts, backoff_s)

    try:
        remote = again(mirror.list_remote)
        what = "writing a probe object in it"
        if mirror.is_local:
            again(lambda: fs.makedirs(mirror.root, exist_ok=True))
        again(lambda: fs.pipe_file(name, b"m3run mirror probe\n"))
        what = "deleting its probe object"
        again(lambda: fs.rm_file(name))
    except MirrorError:
        raise
    except Exception as e:
        raise MirrorError(
            f"checkpoint.mirror_url {mirror.url!r} cannot be used: {what} failed: {cause(e)} "
            f"(fix: {fix_for(mirror, e)}; or set checkpoint.mirror_url=null to train without "
            "a mirror)"
        ) from e
    return remote
