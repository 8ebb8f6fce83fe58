"""The operator's face: the command line (`marketplace.py serve | seed | sweep | backup | restore | check-ledger |
keys | escrow | mcp | chain-demo`) and the running server around the app (signals, the sweeper, the webhook fan-out
and worker, the --metrics-port listener, the heartbeat of a replicated primary, a read replica's watchers).

The rules (marketplace.py) decide; this module starts and stops what runs them, parses flags into Settings, and
prints what an operator reads. It is handed the other faces it starts (the HTTP server, the webhook worker, MCP) in
marketplace.Faces by wiring.py, as the app is.
"""

import argparse
import json
import logging
import math
import os
import re
import signal
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import apsw
import bottle

import metrics
import replication
from marketplace import (HERE, JSON_TYPE, SETTINGS, USDC_BY_CHAIN, Database, Service, Settings, __version__,
                         account_for_key, add_setting_flags, call_app, create_account, fan_out_events, format_units,
                         get_job, iso, json_bytes, ledger_problems, load_settings, log, make_app, now,
                         publish_replicated_jobs, read_address, read_name, replica_lag, request_id, revoke_key,
                         run_sweeps, setting_secrets, write_heartbeat)
from verifier.errors import VerificationError
from verifier.redact import SecretFilter

###############################################################################
# The server ##################################################################
###############################################################################

FILES_BESIDE_CONNECTIONS = 256  # open files the process needs beside its connections: database, logs, webhooks


class JsonLogFormatter(logging.Formatter):
    """--log-format json: a log record as one JSON object on one line (time, level, logger, message[, exception])."""

    def format(self, record):
        line = {'time': iso(datetime.fromtimestamp(record.created, timezone.utc)), 'level': record.levelname,
                'logger': record.name, 'message': record.getMessage()}
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line['exception'] = record.exc_text
        return json.dumps(line)


def raise_open_files_limit(settings):
    """Raise this process's soft limit on open files toward the hard limit, so the connection caps can be reached."""
    try:
        import resource
    except ImportError:         # not a Unix
        return
    wanted = settings.max_connections + FILES_BESIDE_CONNECTIONS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning('could not raise the open files limit from %s to %s: %s', soft, target, exc)
    if hard != resource.RLIM_INFINITY and hard < wanted:
        log.warning('the hard limit on open files (%s) is below --max-connections (%s) plus %s: connections will '
                    'fail before the cap; raise it (ulimit -Hn, or LimitNOFILE= in a systemd unit)',
                    hard, settings.max_connections, FILES_BESIDE_CONNECTIONS)


def sweep_forever(service):
    """Run both sweeps every --sweep-interval seconds, the first one interval after start."""
    import gevent
    while True:
        gevent.sleep(service.settings.sweep_interval)
        started = time.monotonic()
        try:
            result = run_sweeps(service.db, service.settings, fan_out=False)
            service.last_sweep = (time.time(), time.monotonic() - started)
            service.fan_out()
            for job_id in result.get('checkouts', {}).get('opened', ()):
                service.hub.publish(get_job(service.db, job_id))        # paid, and its event never came
        except Exception:
            log.exception('sweep failed; trying again in %s s', service.settings.sweep_interval)
            continue
        checkouts = result.get('checkouts', {})
        if (result['expire']['expired'] or result['expire']['reputationPenalties'] or result['autoVerify']['autoApproved']
                or checkouts.get('opened') or checkouts.get('cancelled')
                or result.get('stripePayments', {}).get('sent') or result.get('stripeAccounts', {}).get('enabled')
                or any(result.get('escrow', {}).values())):
            log.info('sweep: %s', json.dumps(result))


def fan_out_forever(service):
    """Expand the outbox events into deliveries whenever a request wakes it (and every second, for events that
    another process or the sweep command wrote), yielding between batches so that requests are not held."""
    import gevent
    import gevent.event
    service.fan_out_wanted = gevent.event.Event()
    while True:
        service.fan_out_wanted.clear()
        try:
            fan_out_events(service.db, pause=gevent.idle)     # first: what a stopped server left
        except Exception:
            log.exception('webhook fan-out failed; trying again')
            gevent.sleep(1)
        service.fan_out_wanted.wait(timeout=1.0)


# A primary replicated by Litestream (--replica-url) writes a heartbeat, the time in unix milliseconds, every
# --heartbeat-interval seconds; a read replica (--read-replica-of) is as far behind as the newest heartbeat it
# can see is old (the two machines' clocks agree, through NTP). The heartbeat is a row of chain_state, the table
# of small counters, so no schema change: name 'heartbeat_ms'.
REPLICA_POLL_SECONDS = 0.5      # how often a replica looks for new jobs for its streams (the extension: every 1 s)


def watch_replica_forever(service):
    """On a read replica: every second, look at the lag. Past --max-replica-lag, reopen the view of the replica,
    at most once per --max-replica-lag seconds, with one log line saying why: a litestream-vfs connection opened
    before the primary's first compaction stops following at the second one and never catches up (0.5.17, an
    upstream bug: docs/operations.md), while a new connection in the same process reads the replica as it is.
    A primary whose Litestream stopped makes every replica lag too: reopening then changes nothing, and reads go
    on being refused until the heartbeats arrive again.

    A view that caught up after lagging is not trusted either: when the primary's Litestream goes on after a stall,
    its overdue L1 compaction (ending before the changes made meanwhile) and the L0 files holding those changes
    reach the extension in one poll, and if the database grew meanwhile, 0.5.17 replaces its page index with the
    L1 file's pages alone: the changes of those L0 files are lost for good (a job posted during the stall never
    shows) while the later heartbeats do show. So reads stay refused (service.replica_resync_lag) until a fresh
    view, opened after the catch-up, is itself within the limit."""
    import gevent
    limit, reopened = service.settings.max_replica_lag, -math.inf
    while True:
        gevent.sleep(REPLICA_POLL_SECONDS)
        try:
            lag = replica_lag(service.db)
        except apsw.Error:
            # The same upstream bug leaves pages out of the index when they are not cached ("page not found",
            # "database disk image is malformed"): a fresh view, and reads refused till it is within the limit.
            log.exception('reading the replica\'s lag failed; its view of the replica is reopened')
            if service.replica_resync_lag is None:
                service.replica_resync_lag = float(limit)
            try:
                service.db.reopen()
                service.replica_reopenings += 1
            except Exception:
                log.exception('reopening the replica failed; trying again')
            continue
        over = lag is not None and lag > limit
        if over:
            service.replica_resync_lag = lag
        if over and time.monotonic() - reopened >= limit:
            log.warning('read replica %s s behind its primary (over --max-replica-lag %g s): reads are refused, '
                        'and its view of the replica is reopened', lag, limit)
            try:
                service.db.reopen()
                service.replica_reopenings += 1
            except Exception:
                log.exception('reopening the replica failed; trying again in %g s', limit)
            reopened = time.monotonic()
        elif service.replica_resync_lag is not None and not over:
            # the view that caught up may have lost changes: a fresh one, and reads once it is within the limit
            log.info('read replica caught up (%s s behind its primary): its view of the replica is reopened before '
                     'it serves reads again', lag)
            try:
                service.db.reopen()
                service.replica_reopenings += 1
                lag = replica_lag(service.db)
            except Exception:
                log.exception('reopening the replica after it caught up failed; trying again')
                continue
            if lag is not None and lag <= limit:
                service.replica_resync_lag = None


def replicated_jobs_forever(service):
    """On a read replica: every REPLICA_POLL_SECONDS, offer the jobs the primary opened to this server's streams
    (a stream here sees a job within a few seconds of its commit on the primary)."""
    import gevent
    db = service.db
    after_seq, waiting = db.value('SELECT coalesce(max(seq), 0) FROM jobs'), set()
    while True:
        gevent.sleep(REPLICA_POLL_SECONDS)
        try:
            after_seq, waiting = publish_replicated_jobs(db, service.hub, after_seq, waiting)
        except apsw.Error:
            log.exception('reading new jobs from the replica failed; trying again')


def heartbeat_forever(service):
    """On a primary replicated by Litestream: write the heartbeat every --heartbeat-interval seconds."""
    import gevent
    while True:
        try:
            write_heartbeat(service.db)
        except apsw.Error:
            log.exception('the replication heartbeat failed; trying again')
        gevent.sleep(service.settings.heartbeat_interval)


def metrics_app(svc):
    """The WSGI app of the --metrics-port listener: GET /metrics without a key, and nothing else."""
    def answer(environ, start_response):
        method = environ['REQUEST_METHOD']
        headers = [('X-Content-Type-Options', 'nosniff'), ('X-Request-Id', request_id(environ))]
        if environ.get('PATH_INFO') != '/metrics':
            status, body = 404, {'error': 'This listener serves only GET /metrics.', 'code': 'not_found'}
        elif method not in ('GET', 'HEAD'):
            status, body = 405, {'error': 'This path accepts only GET, HEAD.', 'code': 'method_not_allowed'}
            headers.append(('Allow', 'GET, HEAD'))
        else:
            status, body = 200, svc.metrics.scrape()
        if status == 200:
            headers.append(('Content-Type', metrics.CONTENT_TYPE))
        else:
            body = json_bytes(dict(body, status=status))
            headers.append(('Content-Type', JSON_TYPE))
        headers.append(('Content-Length', str(len(body))))
        start_response(f'{status} {bottle.HTTP_CODES[status]}', headers)
        return [b''] if method == 'HEAD' else [body]
    return answer


def listen(server, host, port, before=None):
    """Start a gevent server; a port that cannot be had (in use, not allowed) is a ValueError naming it, after
    stopping the listener started `before` it."""
    try:
        server.start()
    except OSError as exc:
        if before is not None:
            before.stop(timeout=0)
        raise ValueError(f'cannot listen on {host}:{port}: {exc.strerror or exc}') from None


def serve(settings, faces):
    """Serve until SIGTERM or SIGINT, then finish requests in flight and return (exit 0)."""
    import gevent
    app = make_app(settings, faces)
    app.service.background = True
    raise_open_files_limit(settings)
    server = faces.make_server(app, settings)

    def stop(signum):
        log.info('signal %s: stopping (finishing requests in flight)', signum)
        app.service.hub.close()     # open streams send `timeout` and end
        server.close()              # wakes serve_forever, which stops gracefully

    def stop_without_litestream():
        """Stop as on SIGTERM once the litestream that runs this server is gone (killed alone): never serve
        writes that nothing replicates."""
        while not replication.litestream_gone():
            gevent.sleep(1)
        log.error('litestream, which replicates the database, is gone: stopping')
        stop('(litestream gone)')

    gevent.signal_handler(signal.SIGTERM, stop, signal.SIGTERM)
    gevent.signal_handler(signal.SIGINT, stop, signal.SIGINT)
    if os.environ.get(replication.UNDER_LITESTREAM):
        gevent.spawn(stop_without_litestream)
    listen(server, settings.host, settings.port)
    metrics_server = metrics_listener(app, server, settings)
    if app.service.replica:
        serve_replica(app, server, metrics_server, settings)
        return
    sweeper = gevent.spawn(sweep_forever, app.service)
    fan_out = gevent.spawn(fan_out_forever, app.service)
    webhooks = faces.webhook_worker(app.service)
    deliverer = gevent.spawn(webhooks.run)
    heartbeat = gevent.spawn(heartbeat_forever, app.service) if settings.replica_url else None
    payments = 'payments simulated'
    if settings.onchain and settings.onchain.contract:
        payments = (f'payments onchain, chain {settings.chain_id}, escrow in the JobEscrow contract '
                    f'{settings.onchain.contract} (arbiter {settings.onchain.escrow_address})')
    elif settings.onchain:
        payments = f'payments onchain, chain {settings.chain_id}, escrow wallet {settings.onchain.escrow_address}'
    if app.service.x402:
        payments += '; x402: ' + ', '.join(f'{price.endpoint} {price.usdc} USDC' for price in settings.x402_price) \
            + f' to {app.service.x402.pay_to}'
    if settings.replica_url:
        payments += f'; replicated by Litestream to {replication.public_url(settings.replica_url)}'
    log.info('marketplace %s serving on http://%s:%s (database %s, %s)',
             __version__, settings.host, server.server_port, settings.db, payments)
    server.serve_forever(stop_timeout=settings.shutdown_timeout)
    if metrics_server is not None:
        metrics_server.stop(timeout=1)
    sweeper.kill()
    fan_out.kill()
    deliverer.kill()
    if heartbeat is not None:
        heartbeat.kill()
    webhooks.stop()
    log.info('%d group commits made %d write transactions durable', app.service.db.commits, app.service.db.grouped)
    app.service.close()
    log.info('stopped')


def metrics_listener(app, server, settings):
    """The --metrics-port listener, started (None when it is off): without keys, and its scrapes are not counted
    as requests. `server` is stopped when the port cannot be had."""
    if not settings.metrics_port:
        return None
    from gevent.pywsgi import WSGIServer
    listener = WSGIServer((settings.metrics_host, settings.metrics_port), metrics_app(app.service),
                          log=None, error_log=logging.getLogger('marketplace.server'))
    listen(listener, settings.metrics_host, settings.metrics_port, before=server)
    log.info('metrics without a key on http://%s:%s/metrics', settings.metrics_host, settings.metrics_port)
    return listener


def serve_replica(app, server, metrics_server, settings):
    """Serve a read replica (listening already, and on --metrics-port if set) until SIGTERM: reads, and streams
    fed from the replica; no sweep, webhook, fan-out, payout or heartbeat (the primary does all of that)."""
    import gevent
    jobs = gevent.spawn(replicated_jobs_forever, app.service)
    watch = gevent.spawn(watch_replica_forever, app.service)
    writes = f'writes sent to {settings.primary_url}' if settings.primary_url else 'writes refused: no --primary-url'
    log.info('marketplace %s serving on http://%s:%s as a read replica of %s (%s)',
             __version__, settings.host, server.server_port, app.service.db.path, writes)
    server.serve_forever(stop_timeout=settings.shutdown_timeout)
    if metrics_server is not None:
        metrics_server.stop(timeout=1)
    jobs.kill()
    watch.kill()
    app.service.close()
    log.info('stopped')


###############################################################################
# Demo data ###################################################################
###############################################################################

def seed(db_settings, fixtures_path, faces, out=print, keys_file=None):
    """Load the demo fixtures through the API itself; print the demo keys; return them by name."""
    # Demo money is simulated; the demo's arbitrators are active at once and its disputes take three votes.
    settings = Settings(**dict(vars(db_settings), rate_limits='off', rpc_url='', open_arbitration=True,
                               required_votes=3))
    app = make_app(settings, faces)
    db = app.service.db
    if db.value('SELECT count(*) FROM accounts WHERE role = \'member\''):
        raise RuntimeError(f'{settings.db} already holds accounts; seed only a new database')
    fixtures = json.loads(Path(fixtures_path).read_text())
    keys, agents, owners, arbitrators = {}, {}, {}, {}

    def call(method, path, body, key):
        status, _, answer = call_app(app, method, path, body, key)
        if status >= 300:
            raise RuntimeError(f'fixture call {method} {path} failed: {status} {answer}')
        return answer

    for account in fixtures['accounts']:
        keys[account['name']] = create_account(db, account['name'], account.get('role', 'member'))[1]
    for agent in fixtures['agents']:
        agent = dict(agent)
        owners[agent['name']] = keys[agent.pop('owner')]
        agents[agent['name']] = call('POST', '/api/agents', agent, owners[agent['name']])['agent']['id']
    admin_key = next((keys[a['name']] for a in fixtures['accounts'] if a.get('role') == 'admin'), None)
    for arbitrator in fixtures.get('arbitrators', []):
        owner = keys[arbitrator['owner']]
        body = {'name': arbitrator['name'], 'walletAddress': arbitrator['walletAddress'],
                'accountId': account_for_key(db, owner)['id']}
        arbitrator_id = call('POST', '/api/arbitrators', body, admin_key)['arbitrator']['id']
        if arbitrator.get('trusted'):
            call('PATCH', f'/api/arbitrators/{arbitrator_id}', {'trusted': True}, admin_key)
        arbitrators[arbitrator['name']] = (arbitrator_id, owner)
    for job in fixtures['jobs']:
        job = dict(job)
        requester, story = job.pop('requester'), job.pop('story', [])
        job['deadline'] = iso(now() + timedelta(hours=job.pop('deadlineInHours')))
        job_id = call('POST', '/api/jobs', job, keys[requester])['job']['id']
        claim_id = None
        for step in story:
            action, value = next(iter(step.items()))
            if action == 'claim':
                owner_key = owners[value]
                claim_id = call('POST', f'/api/jobs/{job_id}/claim', {'agentId': agents[value]}, owner_key)['claim']['id']
            elif action == 'deliver':
                call('POST', f'/api/jobs/{job_id}/deliver', {'claimId': claim_id, 'deliverable': value}, owner_key)
            elif action == 'verify':
                call('POST', f'/api/jobs/{job_id}/verify', {'claimId': claim_id, 'approved': value}, keys[requester])
            elif action == 'cancel':
                call('POST', f'/api/jobs/{job_id}/cancel', {}, keys[requester])
            elif action == 'dispute':
                dispute_id = call('POST', f'/api/jobs/{job_id}/dispute', {'claimId': claim_id, 'reason': value},
                                  keys[requester])['dispute']['id']
            elif action == 'vote':
                arbitrator_id, voter_key = arbitrators[value['arbitrator']]
                call('POST', f'/api/disputes/{dispute_id}/vote', {'arbitratorId': arbitrator_id, 'vote': value['vote'],
                                                                  'reasoning': value['reasoning']}, voter_key)
    app.service.close()
    out(f'Seeded {settings.db}: {len(fixtures["accounts"])} accounts, {len(agents)} agents, '
        f'{len(arbitrators)} arbitrators, {len(fixtures["jobs"])} jobs.')
    lines = demo_key_lines(fixtures, keys)
    out('Demo API keys (use them as "Authorization: Bearer <key>"; sign in with them on the pages):')
    for line in lines:
        out('  ' + line)
    if keys_file:
        path = Path(keys_file)
        path.unlink(missing_ok=True)
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), 'w') as written:
            written.write(f'# The demo accounts of {settings.db}: name, role, what it does, API key.\n'
                          + '\n'.join(lines) + '\n')
        out(f'Written to {path} (only you can read it).')
    return keys


def demo_key_lines(fixtures, keys):
    """One line per demo account: its name, role, what it does in the fixtures (the agents it owns, the jobs it
    posts, its arbitrator), and its key."""
    does = {name: [] for name in keys}
    for agent in fixtures.get('agents', ()):
        does[agent['owner']].append(f'owns agent {agent["name"]}')
    for arbitrator in fixtures.get('arbitrators', ()):
        does[arbitrator['owner']].append('arbitrates disputes')
    posters = {job['requester'] for job in fixtures.get('jobs', ())}
    roles = {account['name']: account.get('role', 'member') for account in fixtures['accounts']}
    lines = []
    for name, key in keys.items():
        what = (['posts jobs'] if name in posters else []) + does[name] + \
            (['may act on any job, agent or dispute'] if roles[name] == 'admin' else [])
        lines.append(f'{name:<16} {roles[name]:<6} {", ".join(what) or "-":<40} {key}')
    return lines


def chain_demo(settings, serve_args, faces, out=print):
    """`chain-demo` (make chain-demo, CONTRACT 23): rehearse contract mode on a local chain. Start anvil with test
    USDC and deploy the JobEscrow (verifier/rehearsal.py), seed a new --db (its keys in <db>-keys.txt), print what to
    try, then become `serve` with `serve_args` and the chain's flags (exec: the same process, so the chain, tied to
    it, ends when the server does). Returns only on failure (an exception)."""
    from verifier.rehearsal import ARBITER_KEY, CHAIN_ID, LocalChain
    if settings.rpc_url or settings.escrow_contract or settings.usdc_address:
        raise ValueError('it starts a chain of its own: give it no --rpc-url, --escrow-contract or --usdc-address '
                         '(nor their MARKETPLACE_ variables)')
    db = Path(settings.db)
    if db.exists():
        raise ValueError(f'{db} exists: each rehearsal seeds a new database for its new chain (make chain-demo '
                         'removes the last one first)')
    keys_file = db.with_name(db.stem + '-keys.txt')
    chain = LocalChain(f'{db}.anvil.log', settings.fee_percent).start()
    try:
        deployed = chain.deploy()
        keys = seed(settings, HERE / 'fixtures' / 'demo.json', faces, out=out, keys_file=keys_file)
    except BaseException:
        chain.stop()
        raise
    out(chain_demo_guide(settings, chain.url, CHAIN_ID, deployed, keys, keys_file))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, str(HERE / 'marketplace.py'), 'serve', *serve_args,
                               '--rpc-url', chain.url, '--chain-id', str(CHAIN_ID),
                               '--usdc-address', deployed['usdc'], '--escrow-contract', deployed['escrow']],
              dict(os.environ, MARKETPLACE_ESCROW_KEY=ARBITER_KEY))


def chain_demo_guide(settings, rpc_url, chain_id, deployed, keys, keys_file):
    """What `chain-demo` prints before it serves: the chain, its contracts and keys (all test keys), which demo
    wallet goes with which demo account, and what to try."""
    host = '127.0.0.1' if settings.host in ('0.0.0.0', '::', '') else settings.host
    api = settings.public_url.rstrip('/') or f'http://{host}:{settings.port}'
    wallets = dict(zip(('acme-research', 'northwind-data'), deployed['wallets']))   # the demo's two requesters
    first, wallet = next(iter(wallets.items()))
    deadline = iso(now().replace(microsecond=0) + timedelta(days=2)).replace('.000Z', 'Z')
    job = ('{"title": "Rehearsal", "description": "Paid from the JobEscrow.", "category": "code", '
           f'"paymentAmount": "25.00", "deadline": "{deadline}"}}')
    fee = f'{settings.fee_percent} % of each release' if settings.fee_percent else 'the fees (--fee-percent is 0)'
    return '\n'.join([
        '',
        '=' * 100,
        f'Contract mode rehearsed on a local chain (anvil, chain id {chain_id}: not Base) that lives as long as',
        'this server. Its money is TestUSDC, which anyone may mint: NOT real USDC. Every key below is one of anvil\'s',
        'dev keys: TEST KEYS, published everywhere. Never send real funds to their addresses.',
        '',
        f'  RPC URL         {rpc_url}   (this machine only; anvil\'s log: {settings.db}.anvil.log)',
        f'  test USDC       {deployed["usdc"]}   (TestUSDC, 6 decimals)',
        f'  JobEscrow       {deployed["escrow"]}   (fee cap {deployed["maxFeeBps"]} bps, arbiterDelay '
        f'{deployed["arbiterDelay"]} s)',
        f'  arbiter         {deployed["arbiter"]}   the server\'s key: ETH for gas, never any USDC',
        f'  guardian        {deployed["guardian"]}   cancels proposals (marketplace.py escrow cancel)',
        f'                  test key {deployed["guardianKey"]}',
        f'  fee recipient   {deployed["feeRecipient"]}   receives {fee}, from the contract',
        '',
        f'Demo wallets, one per demo account that posts jobs: 10000 ETH and {format_units(wallet["usdc"], "USDC")} '
        'test USDC each.',
        'Any wallet may fund any account\'s job (a deposit names the account it funds, not a wallet).',
        *(line for name, item in wallets.items()
          for line in (f'  {name:<15} {item["address"]}', f'                  test key {item["key"]}')),
        f'The demo accounts\' API keys are above, and in {keys_file}. The seeded jobs are simulated (they settle in',
        'the ledger only); the jobs you fund as below move test USDC.',
        '',
        f'What to try, against {api}:',
        f'  KEY={keys[first]}    # {first}\'s API key',
        f'  1. curl -s {api}/api/health',
        '     -> "payments": "onchain", "escrow": {"mode": "contract", ' + f'"contract": "{deployed["escrow"]}", ...}}',
        f'  2. curl -s {api}/api/jobs -H "Authorization: Bearer $KEY" -H "Content-Type: application/json" \\',
        f"       -d '{job}'",
        '     -> 402 payment_required, with escrowRequirements: the contract, the amount in base units, your',
        '        account\'s hash, minRefundAfter: the deposit that would fund this job',
        f'  3. Fund it from {first}\'s wallet (approve, deposit) and post it with escrowDepositId:',
        ".venv/bin/python - <<'EOF'",
        'import json, os, time, requests',
        'from web3 import Web3',
        'from web3.middleware import SignAndSendRawMiddlewareBuilder',
        f'API, KEY = {api!r}, {keys[first]!r}',
        f'WALLET_KEY = {wallet["key"]!r}',
        f'w3 = Web3(Web3.HTTPProvider({rpc_url!r}))',
        'w3.middleware_onion.inject(SignAndSendRawMiddlewareBuilder.build(WALLET_KEY), layer=0)   # signs locally',
        'me = w3.eth.account.from_key(WALLET_KEY).address',
        f'job = {json.loads(job)!r}',
        "post = lambda **more: requests.post(API + '/api/jobs', json=dict(job, **more),",
        "                                    headers={'Authorization': 'Bearer ' + KEY})",
        "need = post().json()['escrowRequirements']          # the 402: what to deposit",
        "usdc = w3.eth.contract(need['token'], abi=json.load(open('fixtures/TestUSDC.json'))['abi'])",
        "escrow = w3.eth.contract(need['contract'], abi=json.load(open('contracts/JobEscrow.json'))['abi'])",
        "account, amount, refund_after = need['account'], int(need['amount']), need['minRefundAfter']",
        'salt = os.urandom(32)',
        'for call in (usdc.functions.approve(escrow.address, amount),',
        '             escrow.functions.deposit(account, amount, refund_after, salt)):',
        "    w3.eth.wait_for_transaction_receipt(call.transact({'from': me}))",
        "deposit = '0x' + escrow.functions.depositId(me, account, refund_after, salt).call().hex()",
        "while (answer := post(escrowDepositId=deposit)).json().get('code') == 'payment_pending':",
        '    time.sleep(1)                                   # until the deposit is --confirmations deep',
        "job = answer.json()['job']",
        "print(answer.status_code, job['status'], job['escrowStatus'], API + '/jobs/' + job['id'])",
        'EOF',
        '     -> 201 open locked, and the job\'s page: its 25.00 USDC is in the contract, not with the server',
        f'  4. The board: {api}/ (sign in with a demo key). Once a worker has delivered, approving with',
        '     the payer\'s Release signature (releaseTypedData in GET /api/jobs/:id) pays at once; approving without',
        f'     it proposes the payout, which waits {deployed["arbiterDelay"] // 3600} h (the guardian may cancel it).',
        '  5. The guardian\'s watch, from another terminal: every pending proposal, and the job it pays',
        f'     .venv/bin/python marketplace.py escrow proposals --rpc-url {rpc_url} --chain-id {chain_id} \\',
        f'       --escrow-contract {deployed["escrow"]} --db {settings.db}',
        '     Skip the delay on this chain (the next sweep then executes the payout):',
        f'     curl -s {rpc_url} -H "Content-Type: application/json" \\',
        f'       -d \'{{"jsonrpc": "2.0", "id": 1, "method": "evm_increaseTime", "params": [{deployed["arbiterDelay"] + 1}]}}\'',
        'How contract mode works, and what each escrow mode risks: docs/payments-on-chain.md',
        'Ctrl-C stops the server and its chain; the next make chain-demo starts both afresh.',
        '=' * 100,
    ])


###############################################################################
# Command line ################################################################
###############################################################################
def deploy_escrow(settings, args):
    """`escrow deploy`: the JobEscrow contract for this chain's USDC, signed with --deployer-key (else --escrow-key),
    its arguments checked as its constructor does before anything is sent; the contract's address."""
    from verifier.chain import Chain
    from verifier.escrow import deploy
    key = settings.deployer_key or settings.escrow_key
    if not settings.rpc_url or not key:
        raise ValueError('needs --rpc-url and MARKETPLACE_DEPLOYER_KEY (or MARKETPLACE_ESCROW_KEY) to sign with')
    delay = round(args.arbiter_delay_hours * 3600)
    if delay < 3600 or delay >= 2 ** 32:
        raise ValueError('--arbiter-delay-hours must be at least 1 (the contract takes no shorter delay)')
    if not 0 <= args.max_fee_bps <= 10_000:
        raise ValueError('--max-fee-bps must be from 0 to 10000 (100 %)')
    if args.arbiter.lower() in (args.guardian.lower(), args.fee_recipient.lower()):
        raise ValueError('the arbiter (the server\'s key) can be neither the guardian nor the fee recipient')
    token = settings.usdc_address or USDC_BY_CHAIN.get(settings.chain_id)
    if not token:
        raise ValueError(f'--usdc-address is needed on chain {settings.chain_id}')
    chain = Chain(settings.rpc_url, timeout=30)
    if chain.chain_id() != settings.chain_id:
        raise ValueError(f'the node at --rpc-url is not on --chain-id {settings.chain_id}')
    return deploy(chain, key, token=token, arbiter=args.arbiter, guardian=args.guardian,
                  fee_recipient=args.fee_recipient, max_fee_bps=args.max_fee_bps, arbiter_delay=delay,
                  chain_id=settings.chain_id)



def hide_secrets_in_logs(settings):
    """Blank the settings' secrets in every record that reaches the log handlers, whoever logged it (us, web3,
    requests, urllib3, gevent's error log), and send Python warnings (urllib3's) through them too."""
    secret_filter = SecretFilter(setting_secrets(settings))
    for handler in logging.getLogger().handlers:
        handler.addFilter(secret_filter)
    logging.captureWarnings(True)


def restore_database(settings, timestamp=None):
    """Restore the replica to a new --db path, then print the integrity and ledger verdicts; 0 if both pass."""
    if not settings.replica_url:
        print('restore: give --replica-url (file:///dir or s3://bucket/path)', file=sys.stderr)
        return 2
    try:
        replication.restore(settings.db, settings.replica_url, settings.replica_endpoint, timestamp)
    except (replication.ReplicationError, ValueError) as exc:
        print(f'restore: {exc}', file=sys.stderr)
        return 1
    print(f'Restored {replication.public_url(settings.replica_url)} to {settings.db}'
          + (f' as of {timestamp}' if timestamp else ' (latest)'))
    db = Database(settings.db)
    try:
        integrity = [row[0] for row in db.conn.execute('PRAGMA integrity_check')]
        problems = ledger_problems(db)
    finally:
        db.close()
    print('integrity: ok' if integrity == ['ok'] else '\n'.join(['integrity: FAILED', *integrity]))
    print('ledger: balanced' if not problems else '\n'.join(['ledger: FAILED', *problems]))
    return 0 if integrity == ['ok'] and not problems else 1


def escrow_reader(settings):
    """The chain and the JobEscrow at --escrow-contract, for the operator's commands."""
    from verifier.chain import Chain
    from verifier.escrow import EscrowReader
    if not settings.rpc_url or not settings.escrow_contract:
        raise ValueError('needs --rpc-url and --escrow-contract')
    chain = Chain(settings.rpc_url, timeout=30)
    if chain.chain_id() != settings.chain_id:
        raise ValueError(f'the node at --rpc-url is not on --chain-id {settings.chain_id}')
    return chain, EscrowReader(chain, settings.escrow_contract)


def job_of_deposit(settings, deposit):
    """The job a deposit funds in the --db database, or None (no such job, or no database here: the guardian's
    machine need not have one). The file is only read."""
    if not os.path.exists(settings.db):
        return None
    db = Database(settings.db)
    try:
        return db.value('SELECT id FROM jobs WHERE escrow_deposit_id = :id', {'id': deposit.lower()})
    finally:
        db.close()


def list_proposals(settings, from_block, out=print):
    """`escrow proposals`: every proposal pending in the contract, read from the chain (not the database), with
    the job it pays for or "unknown to this database": what the guardian watches. How many."""
    chain, reader = escrow_reader(settings)
    pending = reader.pending_proposals(from_block)
    chain_time = chain.block('latest')['timestamp']
    for proposal in pending:
        when = datetime.fromtimestamp(proposal['executableAt'], timezone.utc)
        left = proposal['executableAt'] - chain_time
        out(f'{proposal["id"]}  job {job_of_deposit(settings, proposal["id"]) or "unknown to this database"}\n'
            f'  executable at {iso(when)} ({"now" if left <= 0 else f"in {left // 3600} h {left % 3600 // 60} min"})'
            f', fee {format_units(proposal["fee"], "USDC")} USDC')
        for payee, amount in zip(proposal['payees'], proposal['amounts']):
            out(f'  pays {format_units(amount, "USDC")} USDC to {payee}')
    out(f'{len(pending)} pending proposal(s) in {reader.address}')
    return len(pending)


def cancel_proposal(settings, target, key_file, out=print):
    """`escrow cancel ID`: cancel a deposit's pending proposal (ID: a deposit id, or the job id it funds), signed
    by the guardian's key read from --guardian-key-file or the terminal, never from the service's environment."""
    import getpass
    from verifier.escrow import key_address, send_call
    chain, reader = escrow_reader(settings)
    deposit = target.lower()
    if not re.fullmatch(r'0x[0-9a-f]{64}', deposit):
        deposit = None
        if os.path.exists(settings.db):
            db = Database(settings.db)
            try:
                deposit = db.value('SELECT escrow_deposit_id FROM jobs WHERE id = :id', {'id': target.lower()})
            finally:
                db.close()
        if deposit is None:
            raise ValueError(f'{target} is neither a deposit id (0x and 64 hex digits) nor a job of --db funded by one')
    if reader.proposal(deposit) is None:
        raise ValueError(f'the deposit {deposit} has no pending proposal')
    key = Path(key_file).read_text().strip() if key_file else getpass.getpass('guardian private key: ').strip()
    guardian = reader.settings()['guardian']
    if key_address(key).lower() != guardian.lower():
        raise ValueError(f'this key is not the contract\'s guardian ({guardian})')
    tx_hash = send_call(chain, key, contract=reader.address, chain_id=settings.chain_id, function='cancel',
                        args=[deposit])
    out(f'cancelled the proposal of {deposit} ({tx_hash}); the service refunds its payer at its next sweep')
    return tx_hash


def main(faces, argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog='marketplace.py', description=__doc__.split('\n')[0])
    commands = parser.add_subparsers(dest='command', required=True)
    common = argparse.ArgumentParser(add_help=False)
    add_setting_flags(common)
    commands.add_parser('serve', parents=[common], help='serve the API')
    seeding = commands.add_parser('seed', parents=[common], help='load the demo fixtures into a new database')
    seeding.add_argument('--fixtures', default=str(HERE / 'fixtures' / 'demo.json'))
    seeding.add_argument('--keys-file', help='also write the demo keys, with their roles, to this file (mode 0600)')
    backup = commands.add_parser('backup', parents=[common], help='online backup of the database to PATH')
    backup.add_argument('path')
    commands.add_parser('check-ledger', parents=[common], help='check that every job balances')
    restoring = commands.add_parser('restore', parents=[common],
                                    help="restore --db (a new path) from Litestream's --replica-url, then check it")
    restoring.add_argument('--timestamp', help='the moment to restore, ISO 8601 (default: the latest)')
    commands.add_parser('sweep', parents=[common], help='run the expire and auto-verify sweeps once (for cron)')
    mcp = commands.add_parser('mcp', parents=[common],
                              help='a Model Context Protocol server on stdio for agents, over the API at --url')
    mcp.add_argument('--http-fd', type=int, help=argparse.SUPPRESS)     # serve's child for /mcp (remote_mcp.py)
    keys = commands.add_parser('keys', help='manage API keys').add_subparsers(dest='keys_command', required=True)
    create = keys.add_parser('create', parents=[common], help='create an account and print its key')
    create.add_argument('--name', required=True, type=read_name)      # as the API reads names
    create.add_argument('--admin', action='store_true', help='give the account the admin role')
    keys.add_parser('list', parents=[common], help='list keys (prefixes only)')
    revoke = keys.add_parser('revoke', parents=[common], help='revoke a key by its id')
    revoke.add_argument('key_id')
    escrow = commands.add_parser('escrow', help='the JobEscrow contract (CONTRACT.md 21)').add_subparsers(
        dest='escrow_command', required=True)
    deploying = escrow.add_parser('deploy', parents=[common], help='deploy the contract at --rpc-url; print it')
    for flag in ('--arbiter', '--guardian', '--fee-recipient'):
        deploying.add_argument(flag, required=True, type=read_address)
    deploying.add_argument('--max-fee-bps', required=True, type=int)
    deploying.add_argument('--arbiter-delay-hours', required=True, type=float)
    watching = escrow.add_parser('proposals', parents=[common],
                                 help="every pending proposal in --escrow-contract, from the chain: the guardian's watch")
    watching.add_argument('--from-block', type=int, default=0,
                          help='the first block to read Proposed events from (a node may cap the range)')
    cancelling = escrow.add_parser('cancel', parents=[common], help="cancel a pending proposal with the guardian's key")
    cancelling.add_argument('id', help='a deposit id, or the job id it funds')
    cancelling.add_argument('--guardian-key-file', help='a file holding the guardian key (else read from the terminal)')
    commands.add_parser('chain-demo', parents=[common],
                        help='rehearse contract mode: a local chain (anvil) with test USDC, the JobEscrow and funded '
                             'demo wallets, and the demo served on it (make chain-demo)')
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format='%(asctime)s %(name)s %(levelname)s %(message)s')
    try:
        settings = load_settings({s.name: getattr(args, s.name, None) for s in SETTINGS})
    except ValueError as exc:
        parser.error(str(exc))
    if settings.log_format == 'json':
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonLogFormatter())
    hide_secrets_in_logs(settings)
    if settings.read_replica_of and settings.replica_url:
        parser.error('--read-replica-of and --replica-url: a read replica has no database of its own to replicate')
    if settings.read_replica_of and args.command != 'serve':
        parser.error('--read-replica-of is for serve: a replica only reads; run this command on the primary')
    if args.command == 'mcp':
        faces.run_mcp(settings.url, settings.api_key, settings.mcp_timeout, args.http_fd)
        return 0
    if args.command == 'serve' and settings.replica_url and not os.environ.get(replication.UNDER_LITESTREAM):
        try:        # becomes litestream, which runs this same command as its child (marked UNDER_LITESTREAM)
            replication.exec_replicated(settings.db, settings.replica_url, settings.replica_endpoint,
                                        [sys.executable, str(HERE / 'marketplace.py'), *argv], settings.log_format)
        except replication.ReplicationError as exc:
            print(f'marketplace.py serve: {exc}', file=sys.stderr)
            return 1
    if args.command == 'serve' and settings.read_replica_of:
        try:        # the extension reads its settings from the environment this process starts with
            replication.exec_with_vfs_environment(settings.read_replica_of, settings.replica_endpoint,
                                                  [sys.executable, str(HERE / 'marketplace.py'), *argv])
        except replication.ReplicationError as exc:
            print(f'marketplace.py serve: {exc}', file=sys.stderr)
            return 1
    if args.command == 'serve':
        try:
            serve(settings, faces)
        except ValueError as exc:
            parser.error(str(exc))
        except replication.ReplicationError as exc:
            print(f'marketplace.py serve: {exc}', file=sys.stderr)
            return 1
        return 0
    if args.command == 'sweep':
        try:
            svc = Service(settings, faces)
        except ValueError as exc:
            parser.error(str(exc))
        print(json.dumps(run_sweeps(svc.db, svc.settings), indent=2))
        svc.close()
        return 0
    if args.command == 'restore':
        return restore_database(settings, args.timestamp)
    if args.command == 'escrow':
        try:
            if args.escrow_command == 'deploy':
                print(deploy_escrow(settings, args))
            elif args.escrow_command == 'proposals':
                list_proposals(settings, args.from_block)
            else:
                cancel_proposal(settings, args.id, args.guardian_key_file)
        except (ValueError, OSError, VerificationError) as exc:
            print(f'escrow {args.escrow_command}: {exc}', file=sys.stderr)
            return 1
        return 0
    if args.command == 'chain-demo':
        try:        # becomes `serve` with the same flags and the chain's, once the chain and the demo are ready
            chain_demo(settings, argv[argv.index('chain-demo') + 1:], faces)
        except (ValueError, OSError, RuntimeError, VerificationError) as exc:
            print(f'chain-demo: {exc}', file=sys.stderr)
            return 1
    if args.command == 'seed':
        try:
            seed(settings, args.fixtures, faces, keys_file=args.keys_file)
        except RuntimeError as exc:
            print(f'seed: {exc}', file=sys.stderr)
            return 1
        return 0
    db = Database(settings.db, replicated=bool(settings.replica_url))
    db.migrate()
    if args.command == 'backup':
        db.backup(args.path)
        print(f'Backed up {settings.db} to {args.path}')
    elif args.command == 'check-ledger':
        problems = ledger_problems(db)
        print('\n'.join(problems) if problems else 'The ledger balances.')
        return 1 if problems else 0
    elif args.keys_command == 'create':
        account, key = create_account(db, args.name, 'admin' if args.admin else 'member')
        print(f'account {account["id"]} ({account["role"]}) {account["name"]}\n{key}')
    elif args.keys_command == 'list':
        for row in db.rows('''SELECT k.id, k.prefix, k.created_at, k.revoked_at, a.name, a.role
                              FROM api_keys k JOIN accounts a ON a.id = k.account_id ORDER BY k.created_at'''):
            state = f'revoked {row["revoked_at"]}' if row['revoked_at'] else 'live'
            print(f'{row["id"]}  {row["prefix"]:<12} {row["role"]:<6} {row["name"]:<24} {state}')
    elif args.keys_command == 'revoke':
        changed = revoke_key(db, args.key_id)
        print('revoked' if changed else 'no live key has that id')
        return 0 if changed else 1
    db.close()
    return 0


