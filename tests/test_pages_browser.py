"""The pages for people in a real browser: Debian's Chromium driven by Playwright (sync API) against
`marketplace.py serve` on a database seeded from fixtures/demo.json.

What a browser alone can tell: the board lists the demo's open jobs newest first; a job posted through
the API arrives at the top of an open board by the live stream (EventSource) without a reload, and only
on boards whose filter it passes; a job's timeline after its claim, delivery and approval; user text is
text everywhere (rendered by the server and built by the board's script); every page works without
JavaScript; nothing scrolls sideways on a phone. Each page visited is saved as a PNG in
artifacts/screenshots/ (board.png is docs/pages.md's picture of the board).

The server is a separate process, so nothing here is monkey-patched by gevent. Without Chromium
(/usr/bin/chromium) the module skips.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from urllib.parse import parse_qs, urlparse

import pytest
import requests

from conftest import ADMIN_KEY, ROOT, LiveServer, random_wallet
from test_server import (TIMEOUT, Output, claim_and_deliver, cli_env, get_job, new_account, new_job, post,
                         register_agent, stop)

CHROMIUM = '/usr/bin/chromium' if os.access('/usr/bin/chromium', os.X_OK) else shutil.which('chromium')
if CHROMIUM is None:
    pytest.skip('Chromium is not installed (/usr/bin/chromium is missing, and no `chromium` on PATH): install '
                "Debian's package with `apt-get install chromium` (.ci/run installs it); the "
                'browser tests drive it with Playwright', allow_module_level=True)
sync_api = pytest.importorskip('playwright.sync_api', reason='playwright is not installed: run `make test`, '
                                                              'which installs requirements.txt into .venv')

LAUNCH_ARGS = ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
               '--disable-component-update', '--disable-sync']
DESKTOP = {'width': 1200, 'height': 900}
PHONE = {'width': 390, 'height': 844}
SCREENSHOTS = ROOT / 'artifacts' / 'screenshots'
PNG_SIGNATURE = b'\x89PNG\r\n\x1a\n'
LIVE_MS = 2000          # how long a new job may take to reach an open board
TIMELINE = ['Posted', 'Escrow locked', 'Claimed', 'Delivered', 'Approved', 'Paid to the worker']
SCRIPT_TITLE = 'Audit <script>window.__pwned = 1</script> this'
IMG_DESCRIPTION = 'Look: <img src="/nowhere.png" onerror="window.__pwned = 2; alert(\'img\')"> and tell me.'

# Before any page script: remember each stream's `connected` event, the server's first event, sent once it has
# subscribed the connection (the board's stream also replays what was posted since the board was listed).
WATCH_STREAMS = '''
window.__streamEvents = [];
(function () {
  var Native = window.EventSource;
  if (!Native) return;
  function Watched(url, options) {
    var source = new Native(url, options);
    source.addEventListener('connected', function () { window.__streamEvents.push(String(url)); });
    return source;
  }
  Watched.prototype = Native.prototype;
  window.EventSource = Watched;
})();
'''


# Fixtures and helpers --------------------------------------------------------

@pytest.fixture(scope='module')
def server(tmp_path_factory):
    """The real server on a database seeded with fixtures/demo.json (`marketplace.py seed`, as `make seed`)."""
    db = tmp_path_factory.mktemp('pages') / 'board.db'
    seeded = subprocess.run([sys.executable, str(ROOT / 'marketplace.py'), 'seed', '--db', str(db)], cwd=ROOT,
                            env=cli_env(), capture_output=True, text=True, timeout=60)
    assert seeded.returncode == 0, seeded.stdout + seeded.stderr
    live = LiveServer(db).start()
    Output(live)            # reads the access log as it comes, so the server never blocks on a full pipe
    yield live
    stop(live)


@pytest.fixture(scope='module')
def browser():
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        yield chromium
        chromium.close()


class Tab:
    """A page in its own browser context, with what it did that a test may want to see: dialogs opened,
    uncaught script errors, main-frame navigations after the first load."""

    def __init__(self, browser, **context_options):
        self.context = browser.new_context(**context_options)
        self.context.set_default_timeout(10_000)
        if context_options.get('java_script_enabled', True):
            self.context.add_init_script(WATCH_STREAMS)
        self.page = self.context.new_page()
        self.dialogs, self.errors, self.navigations = [], [], []
        self.page.on('dialog', self._dialog)
        self.page.on('pageerror', lambda error: self.errors.append(str(error)))
        self.page.on('framenavigated', lambda frame: frame == self.page.main_frame and
                     self.navigations.append(frame.url))

    def _dialog(self, dialog):
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def open(self, server, path):
        """Go to a page; it must answer 200. Navigations counted from here on."""
        answer = self.page.goto(server.url + path)
        assert answer is not None and answer.status == 200, (path, answer and answer.status)
        self.navigations.clear()
        return answer

    def open_board(self, server, path='/'):
        """Open a board and wait until its live stream is subscribed."""
        self.open(server, path)
        wait_until(self.page, 'window.__streamEvents.length > 0', timeout_ms=5000)

    def rows(self):
        """The board's rows, top first: [{id, title, href, category, pay, deadline, datetime}]."""
        return self.page.eval_on_selector_all('#jobs > li.job', '''items => items.map(item => ({
            id: item.getAttribute('data-id'), title: item.querySelector('a.title').textContent,
            href: item.querySelector('a.title').getAttribute('href'),
            category: item.querySelector('.category').textContent, pay: item.querySelector('.pay').textContent,
            deadline: item.querySelector('time.deadline').textContent,
            datetime: item.querySelector('time.deadline').getAttribute('datetime')}))''')

    def row(self, job):
        return self.page.locator(f'#jobs > li.job[data-id="{job["id"]}"]')

    def close(self):
        self.context.close()


@pytest.fixture
def desktop(browser):
    tab = Tab(browser, viewport=DESKTOP)
    yield tab
    tab.close()


@pytest.fixture
def phone(browser):
    tab = Tab(browser, viewport=PHONE, is_mobile=True, has_touch=True, device_scale_factor=2)
    yield tab
    tab.close()


@pytest.fixture
def no_js(browser):
    tab = Tab(browser, viewport=DESKTOP, java_script_enabled=False)
    yield tab
    tab.close()


@pytest.fixture
def requester_key(server):
    """A fresh requester's API key."""
    return new_account(server, 'board-requester')[1]


def wait_until(page, expression, timeout_ms=10_000):
    """Evaluate `expression` in the page until it is true. Not wait_for_function: its polling builds the predicate
    with eval, which the pages' CSP refuses, so it failed whenever the first check came too early."""
    deadline = time.monotonic() + timeout_ms / 1000
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f'not true within {timeout_ms} ms: {expression}'
        page.wait_for_timeout(50)


def screenshot(page, name):
    """Save the whole page as artifacts/screenshots/NAME.png and check that a real PNG was written."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f'{name}.png'
    path.unlink(missing_ok=True)
    page.screenshot(path=str(path), full_page=True)
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), path
    assert len(data) > 5000, (path, len(data))
    return path


def api(server, path, **params):
    answer = requests.get(server.url + path, params=params, timeout=TIMEOUT)
    assert answer.status_code == 200, answer.text
    return answer.json()


def open_jobs(server, **filters):
    return api(server, '/api/jobs', status='open', limit=100, **filters)['jobs']


def due(deadline):
    """How a page shows a deadline: 'due 2026-11-24 16:40 UTC' (no seconds)."""
    moment = datetime.fromisoformat(deadline.replace('Z', '+00:00'))
    return f'due {moment:%Y-%m-%d %H:%M} UTC'


def shown_as_row(job):
    """The row a page should show for a job of the API."""
    return {'id': job['id'], 'title': job['title'], 'href': f'/jobs/{job["id"]}', 'category': job['category'],
            'pay': f'{job["paymentAmount"]} {job["paymentCurrency"]}', 'deadline': due(job['deadline']),
            'datetime': job['deadline']}


# The board -------------------------------------------------------------------

def test_board_lists_the_demo_jobs_newest_first(server, desktop):
    demo = json.loads((ROOT / 'fixtures' / 'demo.json').read_text())['jobs']
    # A demo job with a story was claimed or cancelled by the seed; the others are open.
    expected = [job for job in reversed(demo) if not job.get('story')]
    assert len(expected) >= 3
    seeded_at = datetime.now(timezone.utc)

    desktop.open(server, '/')
    assert desktop.page.locator('h1').inner_text() == 'Open jobs'
    rows = desktop.rows()
    # Jobs the other tests posted are newer, so the demo's open jobs are the board's last rows.
    demo_rows = rows[-len(expected):]
    assert [row['title'] for row in demo_rows] == [job['title'] for job in expected]
    for row, job in zip(demo_rows, expected):
        assert row['category'] == job['category'], row
        assert row['pay'] == f'{job["paymentAmount"]} {job.get("paymentCurrency", "USDC")}', row
        deadline = datetime.fromisoformat(row['datetime'].replace('Z', '+00:00'))
        assert abs(deadline - (seeded_at + timedelta(hours=job['deadlineInHours']))) < timedelta(minutes=10), row
        assert row['deadline'] == due(row['datetime']), row
    # And exactly what the API calls open, in its newest-first order.
    listed = open_jobs(server)
    assert rows == [shown_as_row(job) for job in listed]
    assert desktop.page.locator('#total').inner_text() == str(len(listed))
    assert desktop.errors == []
    screenshot(desktop.page, 'board')


def test_a_posted_job_arrives_on_top_of_an_open_board_without_a_reload(server, desktop, requester_key):
    desktop.open_board(server, '/')
    desktop.page.evaluate('window.__sameDocument = "yes"')
    total = int(desktop.page.locator('#total').inner_text())
    before = desktop.rows()

    job = new_job(server, requester_key, title='Live: rename a CLI flag', category='data', paymentAmount='33.30')
    desktop.row(job).wait_for(timeout=LIVE_MS)

    rows = desktop.rows()
    assert rows[0] == shown_as_row(job)         # the script builds the row the server would render
    assert rows[1:] == before
    assert int(desktop.page.locator('#total').inner_text()) == total + 1
    assert desktop.page.evaluate('window.__sameDocument') == 'yes'
    assert desktop.navigations == []
    assert desktop.errors == []


def test_a_filtered_board_receives_only_the_jobs_its_filter_passes(server, desktop, requester_key):
    desktop.open_board(server, '/?category=code')
    assert desktop.page.locator('select[name=category]').input_value() == 'code'
    total = int(desktop.page.locator('#total').inner_text())

    other = new_job(server, requester_key, title='Live: chart the churn', category='research')
    code = new_job(server, requester_key, title='Live: fix the import cycle', category='code')
    desktop.row(code).wait_for(timeout=LIVE_MS)
    desktop.page.wait_for_timeout(1000)

    assert desktop.row(other).count() == 0
    assert desktop.rows()[0]['id'] == code['id']
    assert {row['category'] for row in desktop.rows()} == {'code'}
    assert int(desktop.page.locator('#total').inner_text()) == total + 1
    assert desktop.navigations == []


def test_an_empty_board_fills_live(server, desktop, requester_key):
    """`custom`: a category no demo job and no other test uses."""
    desktop.open_board(server, '/?category=custom')
    assert desktop.rows() == []
    assert desktop.page.locator('#empty').is_visible()
    assert desktop.page.locator('p.count').inner_text() == '0 open jobs.'

    job = new_job(server, requester_key, title='Live: the first custom job', category='custom')
    desktop.row(job).wait_for(timeout=LIVE_MS)

    assert desktop.page.locator('#empty').count() == 0
    assert [row['id'] for row in desktop.rows()] == [job['id']]
    # Found by this test (fixed): the script updated only the number, so the line read "1 open jobs.".
    assert desktop.page.locator('p.count').inner_text() == '1 open job.'


def test_a_job_posted_while_the_board_connects_its_stream_still_arrives(server, desktop, requester_key):
    """The board was rendered; its EventSource has not reached the server yet when a job is posted."""
    posted = {}

    def post_then_connect(route):
        posted['job'] = new_job(server, requester_key, title='Live: posted while the board loaded', category='data')
        route.continue_()

    desktop.page.route('**/api/jobs/stream*', post_then_connect)
    desktop.open_board(server, '/')
    later = new_job(server, requester_key, title='Live: posted once the stream was open', category='data')
    desktop.row(later).wait_for(timeout=LIVE_MS)             # the stream works
    # Found by this test (fixed): the stream started at "now", so a job posted between the page's rendering and
    # the stream's subscription never showed until a reload; the board's stream now replays from its listing.
    assert desktop.row(posted['job']).count() == 1, 'a job posted while the board loaded never appeared'


# A job's page ----------------------------------------------------------------

def test_job_page_shows_the_timeline_of_a_claim_a_delivery_and_an_approval(server, desktop, requester_key):
    job = new_job(server, requester_key, title='Timeline: tidy the changelog', paymentAmount='42.00',
                  requirements={'language': 'python', 'repo': 'https://github.com/acme/changelog'})
    agent, worker_key = register_agent(server, 'timeline-worker')
    claim_id = claim_and_deliver(server, job, agent['id'], worker_key)
    approved = post(f'{server.url}/api/jobs/{job["id"]}/verify', {'claimId': claim_id, 'approved': True},
                    requester_key)
    assert approved.status_code == 200, approved.text
    assert get_job(server, job['id'])['job']['status'] == 'completed'

    desktop.open(server, f'/jobs/{job["id"]}')
    page = desktop.page
    assert page.locator('h1').inner_text() == job['title']
    # See test_an_approval_keeps_its_order_on_the_timeline (this one failed now and then before that fix).
    assert page.locator('ol.timeline > li strong').all_inner_texts() == TIMELINE
    claims = page.locator('article.claim')
    assert claims.count() == 1
    assert claims.locator('a[href^="/agents/"]').inner_text() == 'timeline-worker'
    assert claims.locator('.status').inner_text().lower() == 'approved'
    assert claims.locator('.deliverable a').count() == 0        # the work is private (CONTRACT.md 18)
    assert claims.locator('.deliverable').inner_text().startswith('Delivered (url), private')
    requirements = page.locator('dl.pairs').inner_text()
    assert 'language' in requirements and 'https://github.com/acme/changelog' in requirements
    assert page.locator('table.payments tbody tr td:nth-child(2)').all_inner_texts() == ['escrow', 'release']
    assert desktop.errors == []
    screenshot(page, 'job')


def test_an_approval_keeps_its_order_on_the_timeline(server, desktop, requester_key):
    """An approval pays the worker in the same transaction, so its page says Approved, then Paid to the worker,
    whichever millisecond each row was stamped with. One approval crosses a millisecond only now and then
    (a few in a hundred here), so this drives a hundred of them."""
    agent, worker_key = register_agent(server, 'busy-worker')
    job_ids = []
    for number in range(100):
        job = new_job(server, requester_key, title=f'Timeline batch {number}')
        claim_id = claim_and_deliver(server, job, agent['id'], worker_key)
        approved = post(f'{server.url}/api/jobs/{job["id"]}/verify', {'claimId': claim_id, 'approved': True},
                        requester_key)
        assert approved.status_code == 200, approved.text
        job_ids.append(job['id'])

    desktop.open(server, f'/jobs/{job_ids[0]}')
    timelines = desktop.page.evaluate('''async ids => {
        const parser = new DOMParser(), steps = {};
        for (const id of ids) {
            const page = parser.parseFromString(await (await fetch('/jobs/' + id)).text(), 'text/html');
            steps[id] = Array.from(page.querySelectorAll('ol.timeline > li strong'), node => node.textContent);
        }
        return steps;
    }''', job_ids)
    wrong = {job_id: steps for job_id, steps in timelines.items() if steps != TIMELINE}
    # Found by this test (fixed): approve_claim stamped the release payment before the claim's verified_at, so
    # when the clock ticked between them the timeline put Paid to the worker before Approved.
    assert wrong == {}, f'{len(wrong)} of {len(job_ids)} timelines out of order, e.g. {next(iter(wrong.values()))}'


# User text is text ----------------------------------------------------------

def assert_not_run(tab):
    assert tab.page.evaluate('typeof window.__pwned') == 'undefined'
    assert tab.dialogs == []
    assert tab.errors == []


def test_markup_in_a_job_is_shown_as_text_on_the_board_live_and_on_its_page(server, desktop, requester_key):
    rendered = new_job(server, requester_key, title=SCRIPT_TITLE, description=IMG_DESCRIPTION, category='data')

    desktop.open_board(server, '/')
    row = desktop.row(rendered)
    assert row.locator('a.title').inner_text() == SCRIPT_TITLE
    assert '<script>' in desktop.page.locator('#jobs').inner_text()
    assert row.locator('script').count() == 0

    live = new_job(server, requester_key, title=SCRIPT_TITLE + ' (live)', description=IMG_DESCRIPTION,
                   category='data')
    desktop.row(live).wait_for(timeout=LIVE_MS)
    assert desktop.row(live).locator('a.title').inner_text() == SCRIPT_TITLE + ' (live)'
    assert desktop.page.locator('#jobs script, #jobs img').count() == 0
    desktop.page.wait_for_timeout(200)
    assert_not_run(desktop)

    for job in (rendered, live):
        desktop.open(server, f'/jobs/{job["id"]}')
        page = desktop.page
        assert page.locator('h1').inner_text() == job['title']
        assert page.title().startswith(SCRIPT_TITLE)
        assert page.locator('.description').first.inner_text() == IMG_DESCRIPTION
        assert page.locator('main script, main img').count() == 0
        page.wait_for_timeout(200)
        assert_not_run(desktop)


# Without JavaScript ----------------------------------------------------------

def test_the_board_and_its_filters_work_without_javascript(server, no_js):
    page = no_js.page
    no_js.open(server, '/')
    assert no_js.rows() == [shown_as_row(job) for job in open_jobs(server)]

    page.locator('select[name=category]').select_option('code')
    with page.expect_navigation():
        page.get_by_role('button', name='Show').click()
    query = parse_qs(urlparse(page.url).query)
    assert query.get('category') == ['code'], page.url
    code_jobs = open_jobs(server, category='code')
    assert 'Fix flaky pagination test' in [job['title'] for job in code_jobs]
    assert no_js.rows() == [shown_as_row(job) for job in code_jobs]
    assert page.locator('select[name=category]').input_value() == 'code'
    assert page.locator('#total').inner_text() == str(len(code_jobs))

    page.locator('input[name=min_pay]').fill('70')
    page.locator('select[name=category]').select_option('')
    with page.expect_navigation():
        page.get_by_role('button', name='Show').click()
    query = parse_qs(urlparse(page.url).query)
    assert query.get('min_pay') == ['70'], page.url
    rich = open_jobs(server, min_pay='70')
    assert {'Summarise ten papers on retrieval evaluation', 'Clean a 50k-row customer CSV'} <= \
        {job['title'] for job in rich}
    assert no_js.rows() == [shown_as_row(job) for job in rich]


# The other pages -------------------------------------------------------------

def test_agents_page(server, desktop):
    desktop.open(server, '/agents')
    page = desktop.page
    assert page.locator('h1').inner_text() == 'Agents'
    names = page.locator('table.leaderboard tbody td:nth-child(2)').all_inner_texts()
    assert {'Scribe', 'Coder-7'} <= set(names)
    scores = [float(score) for score in page.locator('table.leaderboard tbody td.score').all_inner_texts()]
    assert scores == sorted(scores, reverse=True)
    screenshot(page, 'agents')


def test_agent_page_draws_the_reputation_chart(server, desktop):
    scribe = next(agent for agent in api(server, '/api/agents', limit=100)['agents'] if agent['name'] == 'Scribe')
    history = api(server, f'/api/agents/{scribe["id"]}')['reputationHistory']
    assert history and float(history[0]['scoreAfter']) > 0, 'the demo approved one of its deliveries'

    desktop.open(server, f'/agents/{scribe["id"]}')
    page = desktop.page
    assert page.locator('h1').inner_text() == 'Scribe'
    line = page.locator('svg.chart polyline')
    line.wait_for(state='visible')
    box = line.bounding_box()
    assert box['width'] > 100 and box['height'] > 10, box      # the score rose: the line climbs
    assert len(line.get_attribute('points').split()) == len(history) + 1
    assert page.locator('ol.history > li').count() == len(history)
    screenshot(page, 'agent')


def test_dispute_page(server, desktop, requester_key):
    job = new_job(server, requester_key, title='Dispute: translate the error messages')
    agent, worker_key = register_agent(server, 'dispute-worker')
    claim_id = claim_and_deliver(server, job, agent['id'], worker_key)
    opened = post(f'{server.url}/api/jobs/{job["id"]}/dispute',
                  {'claimId': claim_id, 'reason': 'Half of the messages are still in English.'}, requester_key)
    assert opened.status_code == 201, opened.text
    dispute = opened.json()['dispute']

    desktop.open(server, f'/disputes/{dispute["id"]}')
    page = desktop.page
    assert page.locator('h1').inner_text() == 'Dispute'
    assert page.locator('.crumbs a').get_attribute('href') == f'/jobs/{job["id"]}'
    assert 'Half of the messages are still in English.' in page.locator('main').inner_text()
    assert page.locator('.facts .status').inner_text().lower() == 'open'
    assert page.get_by_role('link', name='dispute-worker').get_attribute('href') == f'/agents/{agent["id"]}'
    # The demo's three active arbitrators are the panel; none has voted, and no admin is needed.
    assert len(dispute['panel']) == 3 and page.locator('ul.panel > li').count() == 3
    assert page.locator('ul.panel > li', has_text='has not voted').count() == 3
    assert page.locator('p.needs-admin').count() == 0
    screenshot(page, 'dispute')

    desktop.open(server, f'/jobs/{job["id"]}')
    assert page.locator('ol.timeline > li strong').all_inner_texts()[-1] == 'Disputed'
    assert page.locator('ol.timeline a', has_text='the dispute').get_attribute('href') == f'/disputes/{dispute["id"]}'


def test_arbitrators_page(server, desktop):
    made = post(server.url + '/api/arbitrators', {'name': 'Judge Ada', 'walletAddress': random_wallet()}, ADMIN_KEY)
    assert made.status_code == 201, made.text

    desktop.open(server, '/arbitrators')
    page = desktop.page
    assert page.locator('h1').inner_text() == 'Arbitrators'
    row = page.locator('table.leaderboard tbody tr', has_text='Judge Ada')
    assert row.count() == 1
    assert row.locator('.status').inner_text().lower() == made.json()['arbitrator']['status']
    screenshot(page, 'arbitrators')


# On a phone ------------------------------------------------------------------

def scroll_width(tab):
    return tab.page.evaluate('document.documentElement.scrollWidth')


def test_the_board_fits_a_phone(server, phone, requester_key):
    # A long title (a URL) and a long unbroken word must wrap, not widen the page.
    new_job(server, requester_key, title='Mirror https://github.com/acme-research/retrieval-evaluation/releases/v2')
    new_job(server, requester_key, title='Rename ' + 'supercalifragilistic' * 6)
    phone.open_board(server, '/')
    assert len(phone.rows()) >= 6
    assert scroll_width(phone) <= PHONE['width']
    screenshot(phone.page, 'board-phone')


def test_a_job_page_fits_a_phone(server, phone, requester_key):
    job = new_job(server, requester_key, title='Phone: speed up the invoice export',
                  requirements={'repo': 'https://github.com/acme/billing-and-invoicing-service', 'language': 'python'},
                  acceptanceCriteria=[{'type': 'automated', 'check': 'pytest -q tests/test_invoices.py::'
                                                                    'test_export_of_ten_thousand_invoices_takes_under_a_second'}])
    phone.open(server, f'/jobs/{job["id"]}')
    screenshot(phone.page, 'job-phone')
    # Found by this test (fixed): an acceptance criterion did not wrap a long word, so a pytest node id widened
    # the page to nearly twice the phone's width.
    assert scroll_width(phone) <= PHONE['width']


# The API docs ----------------------------------------------------------------

def documented_operations(server):
    """(METHOD, path) of every operation of the OpenAPI document, once per tag (Swagger UI lists it under each)."""
    document = api(server, '/api/openapi.json')
    return sorted((method.upper(), path) for path, item in document['paths'].items()
                  for method, operation in item.items() for _ in operation['tags'])


def try_out(page, method, path):
    """Expand an operation, press Try it out and Execute; the response body Swagger UI shows, and its status."""
    block = page.locator(f'.opblock-{method}:has(.opblock-summary-path[data-path="{path}"])')
    block.locator('.opblock-summary-control').click()
    block.locator('button.try-out__btn').click()
    block.locator('button.execute').click()
    answer = block.locator('.live-responses-table tbody .response')
    answer.locator('.response-col_status').wait_for()
    return (int(answer.locator('.response-col_status').inner_text().strip()),
            answer.locator('.response-col_description pre').first.inner_text())


def test_api_docs_list_every_operation_and_try_them_on_this_server(server, desktop):
    """/api/docs (Swagger UI served by the service): every operation of the document is on the page; a try-it-out
    of GET /api/jobs shows the list the API gives, and one of GET /metrics sends the key given in Authorize; every
    request of the page goes to the server itself, and the pages' CSP refuses nothing."""
    page, requests_made, console = desktop.page, [], []
    page.on('request', lambda sent: requests_made.append(sent))
    page.on('console', lambda message: console.append(f'{message.type}: {message.text}'))
    desktop.open(server, '/api/docs')
    expected = documented_operations(server)
    wait_until(page, f'document.querySelectorAll(".opblock").length >= {len(expected)}')
    listed = page.eval_on_selector_all('.opblock', '''blocks => blocks.map(block => [
        block.querySelector('.opblock-summary-method').textContent,
        block.querySelector('.opblock-summary-path').getAttribute('data-path')])''')
    assert sorted(map(tuple, listed)) == expected
    assert ('GET', '/api/jobs') in expected and ('GET', '/metrics') in expected
    screenshot(page, 'api-docs')

    status, shown = try_out(page, 'get', '/api/jobs')
    assert status == 200
    assert json.loads(shown) == api(server, '/api/jobs')
    assert [sent.url for sent in requests_made if '/api/jobs' in sent.url] == [    # the defaults filled in
        server.url + '/api/jobs?sort=newest&limit=50&offset=0']

    page.locator('.auth-wrapper button.authorize').click()
    page.locator('.modal-ux input').fill(ADMIN_KEY)
    page.locator('.modal-ux .auth-btn-wrapper button.authorize').click()
    page.locator('.modal-ux button.btn-done').click()
    status, shown = try_out(page, 'get', '/metrics')
    assert status == 200
    assert 'marketplace_http_requests_total{method="GET",route="/api/jobs",status="200"}' in shown
    scrape = next(sent for sent in requests_made if sent.url == server.url + '/metrics')
    assert scrape.headers['authorization'] == f'Bearer {ADMIN_KEY}'

    assert [sent.url for sent in requests_made if not sent.url.startswith(server.url + '/')] == []
    assert [line for line in console if 'Content Security Policy' in line or 'Refused' in line] == []
    assert desktop.errors == []
