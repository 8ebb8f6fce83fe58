"""People acting in the browser, in-process (docs/pages.md "Using it in the browser"): sessions (the cookie's attributes,
only the hash stored, expiry, sign-out), CSRF, the API's refusals in words next to their fields, the form kept as
typed, and every action going through the API's own route and Idempotency-Key. The browser tests of the same
flows in Chromium are tests/test_browser_actions.py."""

import re
from datetime import timedelta
from http.cookies import SimpleCookie
from urllib.parse import urlencode

import pytest

import marketplace as mp
import pages
import wiring
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
    page = Page(answer)         # every character readable (a code block), and a copy button forms.js shows
    assert page.find('p', 'key-text').find('code').text() == key
    [copy] = [button for button in page.find_all('button') if button.attrs.get('data-copy') == 'api-key']
    assert 'hidden' in copy.attrs
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
    app = wiring.make_app(settings)
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
    app = wiring.make_app(settings)
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


# Sessions bound to their key, cookies, sites and redirects (CONTRACT 20) ------------------------------------------

def key_id_of(app, key):
    return app.service.db.value('SELECT id FROM api_keys WHERE key_hash = :h', {'h': mp.hash_key(key)})


def test_revoking_a_key_signs_out_every_session_it_opened_at_once(app, browser):
    _, key = sign_up(browser)
    other = Browser(app)
    assert other.submit('/signin', '/signin', apiKey=key).status == 303
    assert (browser.get('/my/jobs').status, other.get('/my/jobs').status) == (200, 200)
    assert mp.revoke_key(app.service.db, key_id_of(app, key)) is True          # what `keys revoke` does
    assert app.service.db.value('SELECT count(*) FROM sessions') == 0
    for each in (browser, other):
        answer = each.get('/my/jobs')
        assert (answer.status, header_values(answer)['location']) == (303, 'http://market.test/signin')
    assert mp.revoke_key(app.service.db, key_id_of(app, key)) is False         # revoked already


def test_a_session_whose_key_row_is_revoked_by_hand_is_signed_out_too(app, browser):
    _, key = sign_up(browser)
    app.service.db.execute('UPDATE api_keys SET revoked_at = :now WHERE key_hash = :h',
                           {'now': mp.now_iso(), 'h': mp.hash_key(key)})
    assert app.service.db.value('SELECT count(*) FROM sessions') == 1           # the row stays; it acts no more
    assert browser.get('/my/jobs').status == 303
    assert browser.get('/jobs/new').status == 303


def test_a_session_remembers_the_key_it_was_opened_with(app, client, browser):
    _, key = sign_up(browser)
    assert app.service.db.rows('SELECT key_id FROM sessions') == [{'key_id': key_id_of(app, key)}]


@pytest.fixture
def https_app(tmp_path):
    settings = mp.Settings(db=str(tmp_path / 'https.db'), rate_limits='off', public_url='https://market.test')
    app = wiring.make_app(settings)
    yield app
    app.service.close()


def cookie_attributes(header):
    name_value, *attributes = [part.strip() for part in header.split(';')]
    return name_value.split('=', 1)[0], {attribute.split('=', 1)[0].lower(): attribute.partition('=')[2].lower()
                                         for attribute in attributes}


def test_under_an_https_public_url_both_cookies_are_host_prefixed_secure_httponly_lax(https_app):
    browser = Browser(https_app)
    signin = browser.get('/signin')
    name, attributes = cookie_attributes(set_cookie_header(signin))
    assert name == '__Host-mk_form'
    assert attributes == {'httponly': '', 'path': '/', 'samesite': 'lax', 'secure': ''}
    answer, _ = sign_up(browser)
    name, attributes = cookie_attributes(set_cookie_header(answer))
    assert name == '__Host-mk_session'
    assert attributes == {'httponly': '', 'max-age': str(7 * 24 * 3600), 'path': '/', 'samesite': 'lax', 'secure': ''}
    assert browser.get('/my/jobs').status == 200
    signout = browser.submit('/my/jobs', '/signout')
    assert cookie_attributes(set_cookie_header(signout))[0] == '__Host-mk_session'
    assert browser.get('/my/jobs').status == 303


def test_pages_send_hsts_under_an_https_public_url_and_not_over_plain_http(https_app, app):
    browser = Browser(https_app)
    for answer in (browser.get('/'), browser.get('/signin'), browser.get('/jobs/' + '0' * 36),
                   browser.get('/my/jobs')):
        assert header_values(answer)['strict-transport-security'] == 'max-age=31536000', answer
    plain = Browser(app)
    for answer in (plain.get('/'), plain.get('/signin'), plain.get('/my/jobs')):
        assert 'strict-transport-security' not in header_values(answer)


def test_an_unprefixed_cookie_planted_under_https_is_not_read(https_app):
    """Login CSRF: the attacker gets a form cookie and its token from its own visit, plants the cookie in the
    victim's browser from a sibling subdomain or plain http (which cannot set a __Host- cookie), and sends the
    victim's browser to sign in with the attacker's key. Over https only the __Host- cookie counts."""
    attacker = Browser(https_app)
    _, attacker_key = sign_up(attacker, 'Mallory')
    fresh = Browser(https_app)
    token = fresh.hidden('/signin', '/signin')['csrf']
    planted = fresh.cookies['__Host-mk_form']
    victim = Browser(https_app)
    victim.cookies['mk_form'] = planted
    answer = victim.request('POST', '/signin', {'csrf': token, 'apiKey': attacker_key})
    assert answer.status == 403
    assert Page(answer).find('p', 'error').text().startswith('This form has no valid security token (CSRF)')
    assert not any(name.endswith('mk_session') for name in victim.cookies)
    assert https_app.service.db.value('SELECT count(*) FROM sessions') == 1        # the attacker's own


def test_a_planted_form_cookie_cannot_sign_a_victim_into_the_attackers_account(app):
    """Over plain http a sibling subdomain can plant mk_form; its POST is refused for its site."""
    attacker = Browser(app)
    _, attacker_key = sign_up(attacker, 'Mallory')
    fresh = Browser(app)
    token = fresh.hidden('/signin', '/signin')['csrf']
    victim = Browser(app)
    victim.cookies['mk_form'] = fresh.cookies['mk_form']
    for headers in ({'Origin': 'http://evil.market.test', 'Sec-Fetch-Site': 'same-site'},
                    {'Origin': 'http://evil.market.test'}, {'Sec-Fetch-Site': 'same-site'}):
        answer = victim.request('POST', '/signin', {'csrf': token, 'apiKey': attacker_key}, headers=headers)
        assert answer.status == 403, headers
        assert Page(answer).find('p', 'error').text() == pages.CROSS_SITE_WORDS
        assert 'mk_session' not in victim.cookies
    assert app.service.db.value('SELECT count(*) FROM sessions') == 1        # the attacker's own


def page_post_routes():
    return sorted((method, path) for method, path, _, _ in pages.BROWSER_ROUTES if method == 'POST')


def test_every_page_post_route_is_checked_below():
    assert page_post_routes() == [('POST', '/jobs/<job_id>/<action>'), ('POST', '/jobs/new'),
                                  ('POST', '/my/connections/<grant_id>/revoke'), ('POST', '/oauth/authorize'),
                                  ('POST', '/signin'), ('POST', '/signout'), ('POST', '/signup')]


CROSS_SITE = [{'Origin': 'https://evil.test'}, {'Origin': 'null'}, {'Origin': 'http://market.test.evil.test'},
              {'Origin': 'https://market.test'}, {'Origin': 'http://market.test:8080'},
              {'Sec-Fetch-Site': 'cross-site'}, {'Sec-Fetch-Site': 'same-site'},
              {'Origin': 'http://market.test', 'Sec-Fetch-Site': 'cross-site'}]


@pytest.mark.parametrize('headers', CROSS_SITE, ids=lambda headers: ' '.join(f'{k}={v}' for k, v in headers.items()))
def test_a_page_post_from_another_site_is_refused_on_every_route(app, client, browser, headers):
    job_id, claim_id = delivered(app, client, browser)
    _, key = sign_up(Browser(app), 'Bo')
    forms = {'/signin': {'apiKey': key}, '/signup': {'name': 'Eve'}, '/jobs/new': form_fields(), '/signout': {},
             f'/jobs/{job_id}/approve': {'claimId': claim_id}, '/oauth/authorize': {'decision': 'approve'},
             f'/my/connections/{job_id}/revoke': {}}
    hidden = browser.hidden('/jobs/new', '/jobs/new')
    tables = ('sessions', 'accounts', 'jobs', 'claims', 'payments', 'oauth_grants', 'oauth_codes')
    before = {table: app.service.db.rows(f'SELECT * FROM {table}') for table in tables}
    for path, fields in forms.items():
        answer = browser.request('POST', path, {**hidden, **fields}, headers=headers)
        assert answer.status == 403, (path, answer)
        assert Page(answer).find('p', 'error').text() == pages.CROSS_SITE_WORDS
    assert {table: app.service.db.rows(f'SELECT * FROM {table}') for table in tables} == before
    assert browser.get('/my/jobs').status == 200                # still signed in: the sign-out was refused too


def test_a_page_post_from_this_site_is_served(app, client, browser):
    job_id, claim_id = delivered(app, client, browser)
    hidden = browser.hidden(f'/jobs/{job_id}', f'/jobs/{job_id}/approve')
    answer = browser.request('POST', f'/jobs/{job_id}/approve', hidden,
                             headers={'Origin': 'http://market.test', 'Sec-Fetch-Site': 'same-origin'})
    assert answer.status == 303
    assert client.get(f'/api/jobs/{job_id}').json['job']['status'] == 'completed'


def test_without_a_public_url_the_origin_is_compared_with_the_host_not_x_forwarded_host(tmp_path):
    settings = mp.Settings(db=str(tmp_path / 'host.db'), rate_limits='off', trust_proxy=True)
    app = wiring.make_app(settings)
    try:
        browser = Browser(app)
        hidden = browser.hidden('/signin', '/signup')
        forged = browser.request('POST', '/signup', {**hidden, 'name': 'Eve'}, headers={
            'Host': 'market.test', 'X-Forwarded-Host': 'evil.test', 'Origin': 'http://evil.test'})
        assert forged.status == 403
        ours = browser.request('POST', '/signup', {**hidden, 'name': 'Ada'}, headers={
            'Host': 'market.test', 'X-Forwarded-Host': 'evil.test', 'Origin': 'http://market.test'})
        assert ours.status == 200, ours
        assert app.service.db.rows('SELECT name FROM accounts') == [{'name': 'Ada'}]
    finally:
        app.service.close()


FORGED = {'Host': 'evil.test', 'X-Forwarded-Host': 'evil.test'}


def redirects(app, client, browser):
    """Every Location the pages give, each asked with a forged Host and X-Forwarded-Host: [(path, Location)]."""
    seen = []

    def post(path, fields, page=None):
        answer = browser.request('POST', path, {**browser.hidden(page or path, path), **fields}, headers=FORGED)
        assert answer.status == 303, (path, answer)
        seen.append((path, header_values(answer)['location']))
        return answer

    assert browser.request('GET', '/my/jobs', headers=FORGED).status == 303
    seen.append(('/my/jobs', header_values(browser.request('GET', '/my/jobs', headers=FORGED))['location']))
    _, key = sign_up(Browser(app), 'Bo')
    post('/signin', {'apiKey': key})
    posted = post('/jobs/new', form_fields())
    job_id = header_values(posted)['location'].rsplit('/', 1)[1]
    answer = browser.request('GET', f'/jobs/{job_id}/pay', headers=FORGED)       # not waiting for a card payment
    seen.append((f'/jobs/{job_id}/pay', header_values(answer)['location']))
    post(f'/jobs/{job_id}/cancel', {}, f'/jobs/{job_id}')
    post('/signout', {}, '/my/jobs')
    return job_id, seen


def test_no_redirect_is_built_from_a_forged_host(app, client, browser):
    job_id, seen = redirects(app, client, browser)
    assert seen == [('/my/jobs', 'http://market.test/signin'), ('/signin', 'http://market.test/my/jobs'),
                    ('/jobs/new', f'http://market.test/jobs/{job_id}'),
                    (f'/jobs/{job_id}/pay', f'http://market.test/jobs/{job_id}'),
                    (f'/jobs/{job_id}/cancel', f'http://market.test/jobs/{job_id}'),
                    ('/signout', 'http://market.test/')]


def test_without_a_public_url_redirects_are_relative(tmp_path):
    settings = mp.Settings(db=str(tmp_path / 'rel.db'), rate_limits='off', trust_proxy=True)
    app = wiring.make_app(settings)
    try:
        job_id, seen = redirects(app, Client(app), Browser(app))
        assert [location for _, location in seen] == ['/signin', '/my/jobs', f'/jobs/{job_id}', f'/jobs/{job_id}',
                                                      f'/jobs/{job_id}', '/']
    finally:
        app.service.close()


def test_signin_and_signup_have_a_rate_limit_class_of_their_own(tmp_path):
    assert mp.RATE_LIMITS['signin'] == 30
    assert {path: bucket for method, path, _, bucket in pages.BROWSER_ROUTES if path in ('/signin', '/signup')
            and method == 'POST'} == {'/signin': 'signin', '/signup': 'signin'}
    settings = mp.Settings(db=str(tmp_path / 'limits.db'), rate_limits='on', rate_limit_scale=0.1)
    app = wiring.make_app(settings)
    try:
        browser = Browser(app)
        hidden = browser.hidden('/signin', '/signin')
        for left in (2, 1, 0):
            answer = browser.request('POST', '/signin', {**hidden, 'apiKey': 'mk_' + 'x' * 40})
            assert answer.status == 401
            assert (header_values(answer)['x-ratelimit-limit'], header_values(answer)['x-ratelimit-remaining']) == \
                ('3', str(left))
        refused = browser.request('POST', '/signin', {**hidden, 'apiKey': 'mk_' + 'x' * 40})
        assert refused.status == 429 and 'retry-after' in header_values(refused)
        assert browser.get('/signin').status == 200          # the pages' own class is not spent
        made = browser.request('POST', '/signup', {**hidden, 'name': 'Ada'})    # the same class, its own count
        assert made.status == 200
        assert app.service.db.value('SELECT count(*) FROM accounts') == 1
    finally:
        app.service.close()


def test_a_planted_form_cookie_is_worth_nothing_from_another_address_even_without_origin(tmp_path):
    """A browser that sends neither Origin nor Sec-Fetch-Site: the sign-in token is bound to the client's address
    as well as to the form cookie, so the attacker's pair does not validate from the victim's address."""
    settings = mp.Settings(db=str(tmp_path / 'addr.db'), rate_limits='off', trust_proxy=True)
    app = wiring.make_app(settings)
    try:
        attacker = Browser(app)
        _, attacker_key = sign_up(attacker, 'Mallory')
        fresh = Browser(app)
        page = fresh.request('GET', '/signin', headers={'X-Forwarded-For': '203.0.113.66'})
        token = next(f for f in Page(page).find_all('form') if f.attrs.get('action') == '/signin')
        token = next(i.attrs['value'] for i in token.find_all('input') if i.attrs.get('name') == 'csrf')
        victim = Browser(app)
        victim.cookies['mk_form'] = fresh.cookies['mk_form']
        answer = victim.request('POST', '/signin', {'csrf': token, 'apiKey': attacker_key},
                                headers={'X-Forwarded-For': '198.51.100.7'})
        assert answer.status == 403
        assert 'mk_session' not in victim.cookies
        same = fresh.request('POST', '/signin', {'csrf': token, 'apiKey': attacker_key},       # its own address
                             headers={'X-Forwarded-For': '203.0.113.66'})
        assert same.status == 303
        assert app.service.db.value('SELECT count(*) FROM sessions') == 2
    finally:
        app.service.close()
