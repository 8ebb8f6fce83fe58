"""Connecting an MCP host in a real browser (CONTRACT 25): Chromium, driven by Playwright as in
tests/test_pages_browser.py, against `marketplace.py serve` with the pages' own Content-Security-Policy. The host is
a tiny HTTP listener on 127.0.0.1, its redirect URI: approving on the consent page takes the browser there with the
code and the state (the host then exchanges the code), denying takes it there with error=access_denied, and
/my/connections lists the host only once its code has been exchanged. Without Chromium the module skips."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

import marketplace as mp
from conftest import LiveServer
from test_oauth import authorize_url, exchange, me, new_account, pkce, register
from test_pages_browser import browser, sync_api  # noqa: F401  (the fixture: one Chromium a module; skips without it)
from test_server import Output, stop

TIMEOUT = 30


@pytest.fixture(scope='module')
def server(tmp_path_factory):
    live = LiveServer(tmp_path_factory.mktemp('oauth-browser') / 'm.db').start()
    Output(live)
    yield live
    stop(live)


class Host:
    """An MCP host's redirect URI: a listener on 127.0.0.1 that records the query of every request to /callback
    and answers a small page."""

    def __init__(self):
        self.queries = []
        self.arrived = threading.Condition()
        host = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                with host.arrived:
                    host.queries.append(parse_qs(urlsplit(self.path).query))
                    host.arrived.notify_all()
                body = b'<!doctype html><title>Host</title><p>The host got its answer.</p>'
                self.send_response(200)
                self.send_header('Content-Type', 'text/html; charset=utf-8')
                self.send_header('Content-Length', str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(('127.0.0.1', 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.redirect_uri = f'http://127.0.0.1:{self.server.server_address[1]}/callback'

    def wait_for(self, count, timeout=10):
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.queries) >= count, timeout), \
                f'{len(self.queries)} of {count} requests reached the host in {timeout} s'
            return self.queries[count - 1]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def host():
    listener = Host()
    yield listener
    listener.close()


def consent_page(browser, server, host, name):  # noqa: F811  (browser: the fixture)
    """A person signed in (with a new account's key) on the consent page of a newly registered host: (page, the
    client's id, the PKCE verifier)."""
    _, key = new_account(server, name)
    client_id = register(server, [host.redirect_uri], name=f'{name} host').json()['client_id']
    verifier, challenge = pkce()
    context = browser.new_context()
    context.set_default_timeout(10_000)
    page = context.new_page()
    page.policies = []      # the Content-Security-Policy of every answer from /oauth/authorize (GET and POST)
    page.on('response', lambda answer: page.policies.append(answer.headers.get('content-security-policy'))
            if urlsplit(answer.url).path == '/oauth/authorize' else None)
    page.goto(authorize_url(server, client_id, challenge, redirect_uri=host.redirect_uri))
    assert urlsplit(page.url).path == '/signin'
    page.fill('#apiKey', key)
    page.click('button:has-text("Sign in")')
    page.wait_for_url('**/oauth/authorize?**')
    assert page.inner_text('#redirect-host') == urlsplit(host.redirect_uri).netloc
    return page, client_id, verifier


def connections(page, server):
    page.goto(f'{server.url}/my/connections')
    return page.inner_text('main')


def test_approving_in_chromium_takes_the_browser_to_the_host_with_the_code(browser, server, host):  # noqa: F811
    page, client_id, verifier = consent_page(browser, server, host, 'chromium-approver')
    page.click('button[value="approve"]')      # (has-text would match "Sign out (chromium-approver)")
    query = host.wait_for(1)
    page.wait_for_url(host.redirect_uri + '?**')
    assert page.inner_text('body') == 'The host got its answer.'
    assert sorted(query) == ['code', 'state'] and query['state'] == ['xyz']
    # Approved, but the host has not exchanged its code yet: not a connection.
    assert 'No MCP host is connected.' in connections(page, server)
    answer = exchange(server, client_id, query['code'][0], verifier, redirect_uri=host.redirect_uri)
    assert answer.status_code == 200, answer.text
    assert me(server, answer.json()['access_token']).status_code == 200
    listed = connections(page, server)
    assert 'chromium-approver host' in listed and 'No MCP host is connected.' not in listed
    # All of it under the pages' own policy (form-action 'self' included): the first visit (sent to sign in), the
    # consent page, the decision's page.
    assert page.policies == [mp.PAGE_CSP] * 3 and "form-action 'self'" in mp.PAGE_CSP
    page.context.close()


def test_denying_in_chromium_takes_the_browser_to_the_host_with_access_denied(browser, server, host):  # noqa: F811
    page, client_id, _ = consent_page(browser, server, host, 'chromium-denier')
    page.click('button[value="deny"]')
    query = host.wait_for(1)
    page.wait_for_url(host.redirect_uri + '?**')
    assert (query['error'], query['state'], 'code' in query) == (['access_denied'], ['xyz'], False)
    assert 'No MCP host is connected.' in connections(page, server)
    page.context.close()
