"""People acting in the browser, in-process (README "Using it in the browser"): sessions (the cookie's attributes,
only the hash stored, expiry, sign-out), CSRF, the API's refusals in words next to their fields, the form kept as
typed, and every action going through the API's own route and Idempotency-Key. The browser tests of the same
flows in Chromium are tests/test_browser_actions.py."""

import re
from datetime import timedelta
from http.cookies import SimpleCookie
from urllib.parse import urlencode

import pytest

import marketplace as mp
from conftest import Client, in_hours, job_body, make_account, make_agent
from test_pages import Page

FORM = 'application/x-www-form-urlencoded'


class Browser:
    """A person's browser over the in-process app: it keeps cookies and reads forms' hidden fields."""

    def __init__(self, app):
        self.client = Client(app)
        self.cookies = {}

    def request(self, method, path, form=None, headers=None):
        headers = dict(headers or {})
        if self.cookies:
            headers['Cookie'] = '; '.join(f'{name}={value}' for name, value in self.cookies.items())
        body = None
        if form is not None:
            body = urlencode(form).encode()
            headers['Content-Type'] = FORM
        answer = self.client.request(method, path, body, headers=headers)
        cookie = {name.lower(): value for name, value in answer.headers.items()}.get('set-cookie')
        if cookie:
            for name, morsel in SimpleCookie(cookie).items():
                if morsel['max-age'] == '0' or morsel.value == '':
                    self.cookies.pop(name, None)
                else:
                    self.cookies[name] = morsel.value
        return answer

    def get(self, path):
        return self.request('GET', path)

    def hidden(self, path, action):
        """The hidden fields of the form posting to `action` on the page at `path`."""
        page = Page(self.get(path))
        form = next(f for f in page.find_all('form') if f.attrs.get('action') == action)
        return {i.attrs['name']: i.attrs.get('value', '') for i in form.find_all('input')
                if i.attrs.get('type') == 'hidden'}

    def submit(self, path, action, **fields):
        return self.request('POST', action, {**self.hidden(path, action), **fields})


def set_cookie_header(answer):
    return {name.lower(): value for name, value in answer.headers.items()}.get('set-cookie', '')


def sign_up(browser, name='Ada'):
    answer = browser.submit('/signin', '/signup', name=name)
    assert answer.status == 200, answer
    key = Page(answer).find('input', id='api-key').attrs['value']
    return answer, key


@pytest.fixture
def browser(app):
    return Browser(app)


def test_sign_up_shows_the_key_once_and_signs_in_with_a_session_cookie_whose_hash_alone_is_stored(app, browser):
    answer, key = sign_up(browser)
    assert key.startswith('mk_')
    cookie = set_cookie_header(answer)
    assert cookie.startswith('mk_session=') and 'HttpOnly' in cookie and 'SameSite=lax' in cookie.replace('Lax', 'lax')
    assert 'Secure' not in cookie and 'Path=/' in cookie
    assert key not in cookie and header_values(answer).get('cache-control') == 'private, no-store'
    token = browser.cookies['mk_session']
    rows = app.service.db.rows('SELECT * FROM sessions')
    assert [row['id_hash'] for row in rows] == [mp.hash_key(token)]
    assert token not in str(rows) and key not in str(rows)
    my = browser.get('/my/jobs')
    assert my.status == 200 and 'Sign out' in Page(my).find('header', 'top').text()
    assert key.encode() not in my.body       # shown once
    # The key signs in another browser as the same account.
    other = Browser(app)
    assert other.submit('/signin', '/signin', apiKey=key).status == 303
    assert other.get('/my/jobs').status == 200
    assert app.service.db.value('SELECT count(DISTINCT account_id) FROM sessions') == 1


def header_values(answer):
    return {name.lower(): value for name, value in answer.headers.items()}


def test_the_cookie_is_secure_behind_https(tmp_path):
    settings = mp.Settings(db=str(tmp_path / 's.db'), rate_limits='off', public_url='https://market.test')
    app = mp.make_app(settings)
    try:
        answer, _ = sign_up(Browser(app))
        assert 'Secure' in set_cookie_header(answer)
    finally:
        app.service.close()


def test_a_wrong_key_is_refused_in_words_and_signs_nobody_in(browser):
    answer = browser.submit('/signin', '/signin', apiKey='mk_' + 'x' * 40)
    assert answer.status == 401
    assert Page(answer).find('p', 'error').text() == 'The API key is unknown or revoked.'
    assert 'mk_session' not in browser.cookies
    assert browser.get('/my/jobs').status == 303


def test_sign_out_deletes_the_session(app, browser):
    sign_up(browser)
    token = browser.cookies['mk_session']
    answer = browser.submit('/my/jobs', '/signout')
    assert answer.status == 303 and header_values(answer)['location'].endswith('/')
    assert app.service.db.value('SELECT count(*) FROM sessions') == 0
    browser.cookies['mk_session'] = token           # a copy of the old cookie is worth nothing
    assert browser.get('/my/jobs').status == 303


def test_sessions_expire_when_idle_and_after_seven_days_and_the_sweep_deletes_them(app, browser, real_clock):
    start = mp.now()
    real_clock.set(start)
    sign_up(browser)
    real_clock.set(start + timedelta(hours=11))
    assert browser.get('/my/jobs').status == 200             # still alive, and seen now
    real_clock.set(start + timedelta(hours=22, minutes=59))
    assert browser.get('/my/jobs').status == 200
    for hours in range(33, 7 * 24, 10):                       # used every 10 hours, it still ends at 7 days
        real_clock.set(start + timedelta(hours=hours))
        assert browser.get('/my/jobs').status == 200, hours
    real_clock.set(start + timedelta(days=7, seconds=1))
    assert browser.get('/my/jobs').status == 303
    mp.run_sweeps(app.service.db, app.service.settings)
    assert app.service.db.value('SELECT count(*) FROM sessions') == 0
    idle = Browser(app)
    sign_up(idle, 'Bo')
    real_clock.set(start + timedelta(days=7, hours=12, seconds=2))
    assert idle.get('/my/jobs').status == 303                   # 12 idle hours


def test_a_post_without_the_csrf_token_is_a_403_page_and_acts_not(app, browser):
    sign_up(browser)
    fields = browser.hidden('/jobs/new', '/jobs/new')
    del fields['csrf']
    answer = browser.request('POST', '/jobs/new', {**fields, **form_fields()})
    assert answer.status == 403
    assert Page(answer).find('p', 'error').text() == ('This form has no valid security token (CSRF): reload the '
                                                      'page and send the form again.')
    answer = browser.request('POST', '/jobs/new', {**fields, **form_fields(), 'csrf': 'f' * 64})
    assert answer.status == 403
    assert app.service.db.value('SELECT count(*) FROM jobs') == 0
    stranger = Browser(app)             # a sign-up from another site's form: no token bound to its cookie
    assert stranger.request('POST', '/signup', {'name': 'Mallory'}).status == 403
    assert app.service.db.value("SELECT count(*) FROM accounts WHERE name = 'Mallory'") == 0


def form_fields(**overrides):
    fields = {'title': 'Fix the flaky test', 'description': 'It fails one run in ten.', 'category': 'code',
              'paymentAmount': '25.00', 'paymentCurrency': 'USDC', 'deadline': in_hours(48)[:16]}
    fields.update(overrides)
    return fields


def test_posting_a_job_acts_once_per_form_and_leads_to_its_page(app, browser):
    sign_up(browser)
    hidden = browser.hidden('/jobs/new', '/jobs/new')
    first = browser.request('POST', '/jobs/new', {**hidden, **form_fields()})
    again = browser.request('POST', '/jobs/new', {**hidden, **form_fields()})      # a double click, a reload
    assert first.status == again.status == 303
    location = header_values(first)['location']
    assert header_values(again)['location'] == location and re.search(r'/jobs/[0-9a-f-]{36}$', location)
    assert app.service.db.value('SELECT count(*) FROM jobs') == 1
    page = Page(browser.get(location[location.index('/jobs/'):]))
    assert page.find('h1').text() == 'Fix the flaky test'


@pytest.mark.parametrize('overrides, field, words', [
    ({'title': ''}, 'title', 'Title is required'),
    ({'paymentAmount': '12.345'}, 'paymentAmount', 'Pay must be a decimal'),
    ({'deadline': '2001-01-01T00:00'}, 'deadline', 'Deadline must be in the future'),
    ({'requirements': '[1, 2'}, 'requirements', 'Requirements must be'),
])
def test_a_refused_job_shows_the_api_words_next_to_the_field_and_keeps_the_form(app, browser, overrides, field,
                                                                                  words):
    sign_up(browser)
    typed = form_fields(description='Line one\r\nand <b>two</b>', **overrides)
    answer = browser.request('POST', '/jobs/new', {**browser.hidden('/jobs/new', '/jobs/new'), **typed})
    assert answer.status == 400
    page = Page(answer)
    assert page.find('p', 'error').text().strip()
    problem = page.find('p', id=f'{field}-error')
    assert problem.text().startswith(words), problem.text()
    refused = page.find('textarea' if field in ('requirements',) else 'input', id=field)
    assert refused.attrs['aria-invalid'] == 'true' and refused.attrs['aria-describedby'] == f'{field}-error'
    assert 'autofocus' in refused.attrs
    assert b'>Line one\r\nand &lt;b&gt;two&lt;/b&gt;</textarea>' in answer.body
    if field != 'title':
        assert page.find('input', id='title').attrs['value'] == 'Fix the flaky test'
    assert app.service.db.value('SELECT count(*) FROM jobs') == 0


def test_closed_registration_is_refused_in_the_api_words(tmp_path):
    settings = mp.Settings(db=str(tmp_path / 's.db'), rate_limits='off', open_registration=False)
    app = mp.make_app(settings)
    try:
        browser = Browser(app)
        answer = browser.submit('/signin', '/signup', name='Ada')
        assert answer.status == 403
        assert Page(answer).find('p', id='signup-error').text() == ('Open registration is turned off here; ask the '
                                                                     'operator for an API key.')
        assert Page(answer).find('input', id='name').attrs['value'] == 'Ada'
    finally:
        app.service.close()


def delivered(app, client, browser):
    """A job posted from the page and delivered by a worker through the API: (job id, claim id)."""
    sign_up(browser)
    answer = browser.request('POST', '/jobs/new', {**browser.hidden('/jobs/new', '/jobs/new'), **form_fields()})
    job_id = header_values(answer)['location'].rsplit('/', 1)[1]
    _, worker_key = make_account(client, 'worker')
    agent, _ = make_agent(client, worker_key)
    claim = client.post(f'/api/jobs/{job_id}/claim', {'agentId': agent['id']}, key=worker_key).json['claim']
    done = client.post(f'/api/jobs/{job_id}/deliver', {'claimId': claim['id'], 'deliverable': {
        'type': 'url', 'url': 'https://example.com/out?a=1&b=%3C2%3E', 'notes': '[x](javascript:alert(1))'}},
        key=worker_key)
    assert done.status == 200, done
    return job_id, claim['id']


def test_the_requester_reads_the_delivery_as_text_and_rejects_it_with_a_reason(app, client, browser):
    job_id, claim_id = delivered(app, client, browser)
    page = browser.get(f'/jobs/{job_id}')
    assert b'[x](javascript:alert(1))' in page.body and b'href="javascript' not in page.body
    assert b'https://example.com/out?a=1&amp;b=%3C2%3E' in page.body
    answer = browser.submit(f'/jobs/{job_id}', f'/jobs/{job_id}/reject', reason='Not what I asked')
    assert answer.status == 303
    assert client.get(f'/api/jobs/{job_id}').json['job']['status'] == 'rejected'
    assert b'Verdict: Not what I asked' in browser.get(f'/jobs/{job_id}').body


def test_a_refused_action_shows_the_words_and_keeps_the_reason(app, client, browser):
    job_id, claim_id = delivered(app, client, browser)
    hidden = browser.hidden(f'/jobs/{job_id}', f'/jobs/{job_id}/dispute')
    answer = browser.request('POST', f'/jobs/{job_id}/dispute', {**hidden, 'reason': ''})
    assert answer.status == 400
    page = Page(answer)
    assert page.find('p', id=f'action-error-{claim_id}').text().strip()
    answer = browser.request('POST', f'/jobs/{job_id}/approve', {**hidden, 'idempotencyKey': 'k1'})
    assert answer.status == 303
    again = browser.request('POST', f'/jobs/{job_id}/cancel', {**hidden, 'idempotencyKey': 'k2'})
    assert again.status == 409          # approved already: the cancel button is gone, its route still refuses
    assert Page(again).find('p', id='cancel-error').text() != ''


def test_someone_else_cannot_act_on_the_job(app, client, browser):
    job_id, claim_id = delivered(app, client, browser)
    other = Browser(app)
    sign_up(other, 'Eve')
    hidden = other.hidden('/my/jobs', '/signout')
    answer = other.request('POST', f'/jobs/{job_id}/approve', {**hidden, 'claimId': claim_id})
    assert answer.status == 403
    assert client.get(f'/api/jobs/{job_id}').json['job']['status'] == 'delivered'
