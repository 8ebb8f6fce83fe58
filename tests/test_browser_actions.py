"""People acting in the browser, in Chromium (Playwright, as tests/test_pages_browser.py): a whole job's life by
clicks (sign up, post, a second browser context as the worker, review, approve, the payment on the job page), a
rejected delivery, a dispute opened from the page, a USD job through the fake Stripe Checkout, CSRF refused, a
planted form cookie's login CSRF refused, a double submit posting one job, user text escaped, and the same
post-and-approve flow without JavaScript. One server (and one with the fake Stripe) and one browser for the
module. Only 127.0.0.1."""

import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from conftest import LiveServer, random_wallet
from fake_stripe import fake_stripe, fake_stripe_server  # noqa: F401  (the fixtures)
from test_pages_browser import browser, sync_api  # noqa: F401  (the fixture: one Chromium a module; skips without it)
from test_server import Output, stop

SCRIPT_TITLE = '<script>alert(1)</script>'
MARKDOWN_LINK = '[x](javascript:alert(1))'


@pytest.fixture(scope='module')
def server(tmp_path_factory):
    live = LiveServer(tmp_path_factory.mktemp('actions') / 'actions.db').start()
    Output(live)
    yield live
    stop(live)


class Person:
    """One browser context: a person with their own cookies; dialogs (alerts) are recorded."""

    def __init__(self, browser, server, **options):
        self.server = server
        self.context = browser.new_context(**options)
        self.context.set_default_timeout(10_000)
        self.page = self.context.new_page()
        self.dialogs = []
        self.page.on('dialog', lambda dialog: (self.dialogs.append(dialog.message), dialog.dismiss()))

    def go(self, path):
        return self.page.goto(self.server.url + path)

    def sign_up(self, name):
        """Sign up by the form; the API key the next page shows once."""
        self.go('/signin')
        self.page.fill('#name', name)
        self.page.click('button:has-text("Sign up")')
        return self.page.input_value('#api-key')

    def post_job(self, title, amount='25.00', currency='USDC', click='click'):
        self.go('/jobs/new')
        self.page.fill('#title', title)
        self.page.fill('#description', 'Make the tests pass.')
        self.page.fill('#paymentAmount', amount)
        self.page.select_option('#paymentCurrency', currency)
        getattr(self.page, click)('button:has-text("Post the job")')
        landed = re.compile(r'/jobs/[0-9a-f-]{36}$|/c/pay/')         # the job's page, or Checkout
        try:
            self.page.wait_for_url(landed)
        except sync_api.Error:      # a double click: its second sending aborted the first's navigation (it failed
            self.page.wait_for_url(landed)      # once so, ERR_ABORTED): the second lands on the same job's page
        return self.page.url

    def job_id(self):
        return re.search(r'/jobs/([0-9a-f-]{36})', self.page.url).group(1)

    def close(self):
        self.context.close()


def api(server, method, path, body=None, key=None):
    answer = requests.request(method, server.url + path, json=body, timeout=10,
                              headers={'Authorization': f'Bearer {key}'} if key else {})
    assert answer.status_code < 300, answer.text
    return answer.json()


def worker_claims(server, job_id):
    """A worker account and agent made through the API, holding a claim on the job: (key, claim)."""
    worker = api(server, 'POST', '/api/accounts', {'name': 'worker'})
    key = worker['apiKey']
    agent = api(server, 'POST', '/api/agents', {'name': 'builder', 'walletAddress': random_wallet()}, key)['agent']
    claim = api(server, 'POST', f'/api/jobs/{job_id}/claim', {'agentId': agent['id']}, key)['claim']
    return key, claim


def deliver_by_api(server, job_id, key, claim, notes='done'):
    api(server, 'POST', f'/api/jobs/{job_id}/deliver', {'claimId': claim['id'], 'deliverable': {
        'type': 'url', 'url': 'https://example.com/work', 'notes': notes}}, key)


def test_a_whole_job_life_by_clicks(browser, server):
    requester = Person(browser, server)
    worker = Person(browser, server)
    try:
        key = requester.sign_up('Ada')
        assert key.startswith('mk_')
        requester.post_job('Translate the README')
        job_id = requester.job_id()
        assert requester.page.locator('h1').text_content() == 'Translate the README'
        worker_key, claim = worker_claims(server, job_id)
        # The worker signs in with the key in a second browser and delivers from the job's page.
        worker.go('/signin')
        worker.page.fill('#apiKey', worker_key)
        worker.page.click('button:has-text("Sign in")')
        assert worker.page.url.endswith('/my/jobs')
        assert 'Translate the README' in worker.page.locator('.claims').text_content()
        worker.go(f'/jobs/{job_id}')
        worker.page.fill(f'#deliver-url-{claim["id"]}', 'https://example.com/readme-fr')
        worker.page.fill(f'#deliver-notes-{claim["id"]}', 'En français.')
        worker.page.click('button:has-text("Deliver")')
        # The requester reviews it (the link as text) and approves.
        requester.go('/my/jobs')
        assert requester.page.locator('ul[data-status="delivered"]').text_content().count('Translate the README') == 1
        requester.go(f'/jobs/{job_id}')
        assert requester.page.locator('.deliverable .link').text_content() == 'https://example.com/readme-fr'
        assert requester.page.locator('.deliverable .notes').text_content() == 'En français.'
        requester.page.click('button:has-text("Approve and pay")')
        assert requester.page.url == f'{server.url}/jobs/{job_id}'
        assert requester.page.locator('.facts .status').text_content() == 'completed'
        assert 'Paid to the worker' in requester.page.locator('.timeline').text_content()
        payments = requester.page.locator('table.payments tbody tr')
        assert [' '.join(payments.nth(i).locator('td').nth(j).text_content() for j in (1, 2, 3))
                for i in range(payments.count())] == ['escrow 25.00 USDC simulated', 'release 25.00 USDC simulated']
    finally:
        requester.close()
        worker.close()


def test_a_rejected_delivery_and_a_dispute_from_the_page(browser, server):
    requester = Person(browser, server)
    try:
        requester.sign_up('Bea')
        requester.post_job('Rejected one')
        rejected = requester.job_id()
        key, claim = worker_claims(server, rejected)
        deliver_by_api(server, rejected, key, claim)
        requester.go(f'/jobs/{rejected}')
        requester.page.fill(f'#reject-reason-{claim["id"]}', 'Wrong language')
        requester.page.click('button:has-text("Reject")')
        assert requester.page.locator('.facts .status').text_content() == 'rejected'
        assert 'Verdict: Wrong language' in requester.page.locator('.claim').text_content()

        requester.post_job('Disputed one')
        disputed = requester.job_id()
        key, claim = worker_claims(server, disputed)
        deliver_by_api(server, disputed, key, claim)
        requester.go(f'/jobs/{disputed}')
        requester.page.click('button:has-text("Open a dispute")')           # no reason: the API's words
        assert requester.page.locator(f'#action-error-{claim["id"]}').text_content().strip()
        assert requester.page.evaluate('document.activeElement.id') == f'dispute-reason-{claim["id"]}'
        requester.page.fill(f'#dispute-reason-{claim["id"]}', 'Half of it is missing')
        requester.page.click('button:has-text("Open a dispute")')
        assert requester.page.locator('.facts .status').text_content() == 'disputed'
        assert 'Half of it is missing' in requester.page.locator('.timeline').text_content()
    finally:
        requester.close()


def test_csrf_is_refused_and_a_double_submit_posts_one_job(browser, server):
    person = Person(browser, server)
    try:
        key = person.sign_up('Cy')
        person.go('/jobs/new')
        person.page.fill('#title', 'No token')
        person.page.fill('#description', 'x')
        person.page.fill('#paymentAmount', '5.00')
        person.page.locator('form[action="/jobs/new"] input[name=csrf]').evaluate('input => input.remove()')
        answer = None
        with person.page.expect_navigation() as navigation:
            person.page.click('button:has-text("Post the job")')
        answer = navigation.value
        assert answer.status == 403
        assert 'security token (CSRF)' in person.page.locator('p.error').text_content()
        person.post_job('Posted once', click='dblclick')
        mine = api(server, 'GET', '/api/jobs?limit=200')['jobs']
        assert [job['title'] for job in mine].count('Posted once') == 1
        assert key
    finally:
        person.close()


class Trap:
    """The attacker's site on another port of 127.0.0.1 (same site, another origin, like a sibling subdomain):
    its page plants a form cookie (cookies ignore ports) and holds a sign-in form to the service."""

    def __init__(self, cookie, body):
        trap = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                data = trap.body.encode()
                self.send_response(200)
                self.send_header('Content-Type', 'text/html; charset=utf-8')
                self.send_header('Set-Cookie', trap.cookie)
                self.send_header('Content-Length', str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass
        self.cookie, self.body = cookie, body
        self.http = ThreadingHTTPServer(('127.0.0.1', 0), Handler)
        self.url = f'http://127.0.0.1:{self.http.server_port}'
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self):
        self.http.shutdown()
        self.http.server_close()


def test_a_planted_form_cookie_cannot_sign_the_victim_into_the_attackers_account(browser, server):
    """Login CSRF (issue 29, 7): the attacker fetches a form cookie and its token, plants the cookie in the
    victim's Chromium from its own origin and sends the victim's browser to sign in with the attacker's key. The
    browser says where the form came from (Origin, Sec-Fetch-Site): 403, and the victim is signed in as nobody."""
    attacker_key = api(server, 'POST', '/api/accounts', {'name': 'mallory'})['apiKey']
    visit = requests.get(server.url + '/signin', timeout=10)
    token = re.search(r'name="csrf" value="([0-9a-f]{64})"', visit.text).group(1)
    form = (f'<form method="post" action="{server.url}/signin"><input type="hidden" name="csrf" value="{token}">'
            f'<input type="hidden" name="apiKey" value="{attacker_key}"><button>Win a prize</button></form>')
    trap = Trap(f'mk_form={visit.cookies["mk_form"]}; Path=/; SameSite=Lax', form)
    victim = Person(browser, server)
    try:
        victim.page.goto(trap.url + '/')
        with victim.page.expect_navigation() as navigation:
            victim.page.click('button:has-text("Win a prize")')
        assert navigation.value.status == 403
        assert 'sent from another site' in victim.page.locator('p.error').text_content()
        assert [c['name'] for c in victim.context.cookies(server.url) if c['name'].endswith('mk_session')] == []
        victim.go('/my/jobs')
        assert victim.page.url == server.url + '/signin'
    finally:
        victim.close()
        trap.close()


def test_user_text_is_escaped_on_the_pages_that_act(browser, server):
    person = Person(browser, server)
    try:
        person.sign_up(SCRIPT_TITLE)
        person.post_job(SCRIPT_TITLE)
        job_id = person.job_id()
        key, claim = worker_claims(server, job_id)
        deliver_by_api(server, job_id, key, claim, notes=MARKDOWN_LINK)
        person.go(f'/jobs/{job_id}')
        assert person.page.locator('h1').text_content() == SCRIPT_TITLE
        assert person.page.locator('.deliverable .notes').text_content() == MARKDOWN_LINK
        assert person.page.locator('a[href^="javascript"]').count() == 0
        assert SCRIPT_TITLE in person.page.locator('header .who').text_content()
        person.go('/my/jobs')
        assert person.page.locator('ul[data-status="delivered"] a.title').text_content() == SCRIPT_TITLE
        assert person.dialogs == []
    finally:
        person.close()


def test_post_and_approve_without_javascript(browser, server):
    person = Person(browser, server, java_script_enabled=False)
    try:
        person.sign_up('NoScript')
        person.go('/jobs/new')
        person.page.fill('#title', 'Without scripts')
        person.page.fill('#description', 'x')
        person.page.fill('#paymentAmount', 'lots')
        person.page.click('button:has-text("Post the job")')
        assert person.page.locator('#paymentAmount').get_attribute('aria-invalid') == 'true'
        assert person.page.input_value('#title') == 'Without scripts'
        person.page.fill('#paymentAmount', '7.50')
        person.page.click('button:has-text("Post the job")')
        job_id = person.job_id()
        key, claim = worker_claims(server, job_id)
        deliver_by_api(server, job_id, key, claim)
        person.go(f'/jobs/{job_id}')
        person.page.click('button:has-text("Approve and pay")')
        assert person.page.locator('.facts .status').text_content() == 'completed'
        assert 'Paid to the worker' in person.page.locator('.timeline').text_content()
    finally:
        person.close()


def test_a_usd_job_through_the_fake_stripe_checkout(browser, tmp_path, fake_stripe):       # noqa: F811
    env = {'MARKETPLACE_STRIPE_SECRET_KEY': fake_stripe.secret_key,
           'MARKETPLACE_STRIPE_WEBHOOK_SECRET': fake_stripe.webhook_secret,
           'MARKETPLACE_STRIPE_API_BASE': fake_stripe.url}
    stripe_server = LiveServer(tmp_path / 'stripe.db', ['--allow-simulated-rails'], env=env).start()
    Output(stripe_server)
    fake_stripe.webhook_url = stripe_server.url + '/api/stripe/webhook'
    person = Person(browser, stripe_server)
    try:
        person.sign_up('Dee')
        url = person.post_job('Paid by card', amount='40.00', currency='USD')
        assert url.startswith(fake_stripe.url + '/c/pay/')        # through our /pay page, then Stripe's
        [job_id] = [s['client_reference_id'] for s in fake_stripe.sessions.values()]
        person.go(f'/jobs/{job_id}')
        assert 'Pending until paid' in person.page.locator('#pending').text_content()
        assert requests.get(f'{stripe_server.url}/jobs/{job_id}', timeout=10).status_code == 404   # the public
        person.page.click('text=Pay now')
        person.page.click('button:has-text("Pay")')
        assert person.page.url == f'{stripe_server.url}/jobs/{job_id}'
        assert person.page.locator('.facts .status').text_content() == 'open'
        assert 'Escrow locked' in person.page.locator('.timeline').text_content()
    finally:
        person.close()
        stop(stripe_server)
