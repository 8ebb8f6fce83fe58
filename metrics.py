"""Prometheus metrics of the service: the only module that imports prometheus_client.

Each Service has its own Metrics (its own CollectorRegistry, not the global one), so that tests building many apps
in one process do not collide. Requests are counted as they are answered; the state of the service (streams,
webhook outbox, pending payments, sweeps, the chain, the database file) is read when Prometheus scrapes, from a
snapshot the app gives (`read_state`), so that nothing here knows SQL or the app's objects.
"""

import bisect
import time
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # the text format every Prometheus reads (2.x and 3.x)
UNMATCHED = '(unmatched)'               # the route label of a request that matched no route (404, 405)
METHODS = frozenset(('GET', 'HEAD', 'POST', 'PUT', 'PATCH', 'DELETE', 'OPTIONS'))
disable_created_metrics()       # no *_created series: they double the output and say nothing a scraper needs
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class State:
    """What the service is doing, read at scrape time; None where it does not apply (no sweep yet, no chain)."""

    open_streams: int = 0
    webhook_deliveries: dict = field(default_factory=dict)      # status -> count ('pending', 'failed')
    payments_pending: dict = field(default_factory=dict)        # (rail, kind) -> count, kind 'payout' or 'refund'
    last_sweep_at: float = None         # unix time the last automatic sweep ended
    last_sweep_seconds: float = None    # how long it took
    chain_reachable: bool = None        # onchain mode only
    database_bytes: int = 0             # the database file and its WAL
    replica_lag: float = None           # a read replica only: seconds behind its primary (None before a heartbeat)
    replica_reopenings: int = None      # a read replica only: views reopened (lagged, caught up, failed)
    escrow_proposals: dict = None       # contract mode only: {'waiting': to propose, 'proposed': waiting to run}
    read_cache: tuple = None            # (hits, misses, bytes kept) of the read cache, when there is one
    jobs_needing_admin: int = 0         # jobs whose needsAdmin the chain set (CONTRACT 25)


class StateCollector:
    """Gauges of the service's state, built from read_state() at each scrape."""

    def __init__(self, read_state):
        self.read_state = read_state

    def collect(self):
        state = self.read_state()
        yield GaugeMetricFamily('marketplace_open_streams', 'Open /api/jobs/stream connections.',
                                value=state.open_streams)
        deliveries = GaugeMetricFamily('marketplace_webhook_deliveries',
                                       'Webhook deliveries waiting for an attempt (pending) or given up (failed).',
                                       labels=['status'])
        for status, count in sorted(state.webhook_deliveries.items()):
            deliveries.add_metric([status], count)
        yield deliveries
        payments = GaugeMetricFamily('marketplace_payments_pending',
                                     'Payouts to workers and refunds to requesters sent but not yet confirmed, '
                                     'by rail.', labels=['rail', 'kind'])
        for (rail, kind), count in sorted(state.payments_pending.items()):
            payments.add_metric([rail, kind], count)
        yield payments
        if state.last_sweep_at is not None:
            yield GaugeMetricFamily('marketplace_last_sweep_timestamp_seconds',
                                    'Unix time the last automatic sweep (expiry, auto-verify, payouts) ended.',
                                    value=state.last_sweep_at)
            yield GaugeMetricFamily('marketplace_last_sweep_duration_seconds', 'How long the last sweep took.',
                                    value=state.last_sweep_seconds)
        if state.chain_reachable is not None:
            yield GaugeMetricFamily('marketplace_chain_reachable',
                                    '1 if the chain node answered its last check (at most 2 s old), else 0.',
                                    value=int(state.chain_reachable))
        yield GaugeMetricFamily('marketplace_database_bytes', 'Size of the SQLite database file and its WAL.',
                                value=state.database_bytes)
        if state.replica_lag is not None:
            yield GaugeMetricFamily('marketplace_replica_lag_seconds',
                                    "A read replica: seconds since the newest primary's heartbeat it can read.",
                                    value=state.replica_lag)
        if state.replica_reopenings is not None:
            yield CounterMetricFamily('marketplace_replica_reopenings',
                                      'A read replica: times its view of the replica was reopened (it lagged more '
                                      'than --max-replica-lag, caught up after lagging, or failed a read).',
                                      value=state.replica_reopenings)
        if state.escrow_proposals is not None:
            proposals = GaugeMetricFamily('marketplace_escrow_proposals_pending',
                                          'Contract mode: jobs whose payouts without a signature wait to be proposed '
                                          '(waiting) or proposed and waiting out the delay (proposed).',
                                          labels=['state'])
            for state_name, count in sorted(state.escrow_proposals.items()):
                proposals.add_metric([state_name], count)
            yield proposals
        yield GaugeMetricFamily('marketplace_jobs_needing_admin',
                                'Jobs whose money the chain and the ledger disagree on (a call that reverted, a '
                                'deposit holding less than the job owes): needsAdmin, CONTRACT 25.',
                                value=state.jobs_needing_admin)
        if state.read_cache is not None:
            hits, misses, kept = state.read_cache
            yield CounterMetricFamily('marketplace_read_cache_hits', 'Reads answered from the read cache.', value=hits)
            yield CounterMetricFamily('marketplace_read_cache_misses', 'Cacheable reads the handler answered.',
                                      value=misses)
            yield GaugeMetricFamily('marketplace_read_cache_hit_ratio', 'Hits over cacheable reads (0 before any).',
                                    value=hits / (hits + misses) if hits + misses else 0.0)
            yield GaugeMetricFamily('marketplace_read_cache_bytes', 'Bytes of answers the read cache keeps.',
                                    value=kept)


class RequestCollector:
    """The answers counted by method, route template and status, and their durations by method and route, in plain
    numbers: counting one costs a few dictionary operations (prometheus_client's Counter and Histogram take a lock
    per increment, 4 % of a small answer's CPU); the families are built when Prometheus scrapes."""

    def __init__(self):
        self.answers = {}       # (method, route, status) -> answers (bounded: templates only)
        self.durations = {}     # (method, route) -> [answers per bucket (the last: above them all), sum of seconds]

    def count(self, key, seconds):
        self.answers[key] = self.answers.get(key, 0) + 1
        series = self.durations.get(key[:2])
        if series is None:
            series = self.durations[key[:2]] = [[0] * (len(DURATION_BUCKETS) + 1), 0.0]
        series[0][bisect.bisect_left(DURATION_BUCKETS, seconds)] += 1      # the first bucket it is at most
        series[1] += seconds

    def collect(self):
        answers = CounterMetricFamily('marketplace_http_requests', 'HTTP answers by method, route template and status.',
                                      labels=['method', 'route', 'status'])
        for key, count in sorted(self.answers.items()):
            answers.add_metric(list(key), count)
        yield answers
        durations = HistogramMetricFamily('marketplace_http_request_duration_seconds',
                                          'Seconds from a request to its answer\'s headers (a stream: its first '
                                          'event), by method and route template.', labels=['method', 'route'])
        for key, (buckets, total) in sorted(self.durations.items()):
            cumulative, running = [], 0
            for bound, count in zip((*DURATION_BUCKETS, float('inf')), buckets):
                running += count
                cumulative.append((floatToGoString(bound), running))
            durations.add_metric(list(key), cumulative, total)
        yield durations


class Metrics:
    """One service's series: requests counted by count_request, state gauges read at each scrape."""

    def __init__(self, read_state):
        self.registry = CollectorRegistry()   # its own: never the process-wide default
        self.requests = RequestCollector()
        self.registry.register(self.requests)
        self.registry.register(StateCollector(read_state))

    def count_request(self, method, route, status, started):
        """Count one answer: `route` is the route template (None: no route matched), `started` its
        time.perf_counter() at arrival."""
        self.requests.count((method if method in METHODS else 'other', route or UNMATCHED, str(status)),
                            time.perf_counter() - started)

    def scrape(self):
        """The text exposition of every series."""
        return generate_latest(self.registry)
