"""The page fixes of a newcomer's first hour (CONTRACT.md 23, "Pages") in Debian's Chromium, driven by Playwright as in
tests/test_pages_browser.py: the site's name (`--site-name`) in every title and header and its icon; the new key
after signing up shown whole in a code block and copied by its button; transaction hashes short in a job's payments
table, whole on hover and in their links; the board filtered by status; the post form's extra options spaced, each
competition mode explained in a sentence, each job of a board of other statuses showing its status. Screenshots
(desktop, and a phone for the signed-up page, the post form and the payments) go to artifacts/screenshots/; the
favicon, the post form's options and the payments table also alone.

One server for the module: `marketplace.py serve --site-name ...` on the demo's database, in onchain mode on the
session's anvil (chain 8453, so hashes link to basescan.org) when anvil is installed; without it, ledger mode, and
only the hashes' test skips. Whatever this module does to the chain is reverted at its end.
"""

import re
import subprocess
import sys
import time
from urllib.parse import parse_qs, urlparse

import pytest

from conftest import ROOT, LiveServer
from test_pages_browser import browser  # noqa: F401 (a fixture: one Chromium a module; the module skips without it)
from test_pages_browser import (DESKTOP, PHONE, PNG_SIGNATURE, SCREENSHOTS, Tab, api, screenshot, scroll_width,
                                shown_as_row, sync_api, wait_until)
from test_server import Output, claim_and_deliver, cli_env, stop

SITE_NAME = 'Harbor & Quay Jobs'       # an ampersand: the name is text wherever it is shown
BOARD_STATUSES = ['open', 'claimed', 'delivered', 'disputed', 'completed', 'rejected', 'refunded', 'expired',
                  'cancelled', 'any']
HASH = re.compile(r'0x[0-9a-f]{64}')
EXPLORER = 'https://basescan.org'      # chain 8453's
expect = sync_api.expect
TEXTS = 'elements => elements.map(element => element.textContent)'


# Fixtures and helpers --------------------------------------------------------

@pytest.fixture(scope='module')
def chain(request):
    """The session's anvil (conftest.py), or None where it is not installed. Put back as it was afterwards."""
    try:
        node = request.getfixturevalue('anvil')
    except pytest.skip.Exception:
        yield None
        return
    if node.timestamp() < time.time() - 60:     # a funding transfer is dated by its block: bring the clock to now
        node.set_next_timestamp(int(time.time()))
        node.mine()
    snapshot = node.snapshot()
    yield node
    node.automine(True)
    node.revert(snapshot)


@pytest.fixture(scope='module')
def server(tmp_path_factory, chain):
    """`marketplace.py serve --site-name SITE_NAME` on a database seeded from fixtures/demo.json; onchain on `chain`."""
    db = tmp_path_factory.mktemp('newcomer') / 'demo.db'
    seeded = subprocess.run([sys.executable, str(ROOT / 'marketplace.py'), 'seed', '--db', str(db)], cwd=ROOT,
                            env=cli_env(), capture_output=True, text=True, timeout=60)
    assert seeded.returncode == 0, seeded.stdout + seeded.stderr
    args, env = ['--site-name', SITE_NAME], None
    if chain is not None:
        from test_onchain import ESCROW_KEY, onchain_args
        args, env = [*args, *onchain_args(chain.url)], {'MARKETPLACE_ESCROW_KEY': ESCROW_KEY}
    live = LiveServer(db, args, env=env).start()
    Output(live)            # reads the access log as it comes, so the server never blocks on a full pipe
    yield live
    stop(live)


@pytest.fixture
def tabs(browser):
    """tabs(**context options): a new Tab (test_pages_browser); all closed after the test."""
    made = []

    def tab(**options):
        made.append(Tab(browser, **options))
        return made[-1]
    yield tab
    for each in made:
        each.close()


PHONE_OPTIONS = {'viewport': PHONE, 'is_mobile': True, 'has_touch': True, 'device_scale_factor': 2}


def sign_up(tab, server, name):
    """Sign up by the sign-in page's form; the key the next page shows."""
    tab.open(server, '/signin')
    tab.page.fill('#name', name)
    with tab.page.expect_navigation():
        tab.page.click('form[action="/signup"] button[type="submit"]')
    assert tab.page.locator('h1').inner_text() == f'Welcome, {name}'
    return tab.page.input_value('#api-key')


def boxes(locator):
    """The bounding boxes of the visible elements a locator matches, in document order: [{x, y, width, height}]."""
    return [box for box in (element.bounding_box() for element in locator.all()) if box and box['height'] > 0]


def overlap(a, b, slack=0.5):
    """Whether two boxes share more than `slack` pixels each way."""
    return (min(a['x'] + a['width'], b['x'] + b['width']) - max(a['x'], b['x']) > slack and
            min(a['y'] + a['height'], b['y'] + b['height']) - max(a['y'], b['y']) > slack)


def element_screenshot(element, name):
    """Save what one element (or a page's viewport) shows as artifacts/screenshots/NAME.png."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f'{name}.png'
    path.unlink(missing_ok=True)
    element.screenshot(path=str(path))
    assert path.read_bytes().startswith(PNG_SIGNATURE), path
    return path


def assert_site_name(page, title):
    assert page.title() == f'{title} · {SITE_NAME}'
    assert page.locator('header.top a.brand').inner_text() == SITE_NAME


# KEY_GLYPHS: each character of the code block's text with its box (a Range's), the block's box, its font and text;
# KEY_FIELD: the input's font and the height its text has inside it.
KEY_GLYPHS = '''code => {
    const text = code.firstChild, range = document.createRange(), style = getComputedStyle(code);
    const glyphs = Array.from(code.textContent, (character, at) => {
        range.setStart(text, at); range.setEnd(text, at + 1);
        const box = range.getBoundingClientRect();
        return {character, top: box.top, bottom: box.bottom, left: box.left, right: box.right};
    });
    const box = code.getBoundingClientRect();
    return {glyphs, box: {top: box.top, bottom: box.bottom, left: box.left, right: box.right},
            font: style.fontFamily, size: parseFloat(style.fontSize), lineHeight: parseFloat(style.lineHeight),
            text: code.innerText,
            clipped: code.scrollWidth > code.clientWidth || code.scrollHeight > code.clientHeight};
}'''
KEY_FIELD = '''field => {
    const style = getComputedStyle(field);
    return {font: style.fontFamily, size: parseFloat(style.fontSize),
            inner: field.clientHeight - parseFloat(style.paddingTop) - parseFloat(style.paddingBottom)};
}'''


def assert_key_shown_whole(page, key, width):
    """The key's code block: monospace, at least 16 px, its text the key exactly, every character (each underscore
    too) drawn inside the block and inside the page's width; the input also monospace and tall enough for its text."""
    shown = page.locator('p.key-text code').evaluate(KEY_GLYPHS)
    assert shown['text'] == key
    assert 'monospace' in shown['font'] and shown['size'] >= 16, shown['font']
    assert shown['lineHeight'] >= 1.4 * shown['size']        # room below the baseline: an underscore is not cut
    assert not shown['clipped']
    block = shown['box']
    assert block['right'] <= width, block
    assert ''.join(glyph['character'] for glyph in shown['glyphs']) == key
    for glyph in shown['glyphs']:
        assert glyph['bottom'] > glyph['top'] and glyph['right'] > glyph['left'], glyph
        assert block['top'] <= glyph['top'] and glyph['bottom'] <= block['bottom'], glyph
        assert block['left'] <= glyph['left'] and glyph['right'] <= block['right'], glyph
    underscores = [glyph for glyph in shown['glyphs'] if glyph['character'] == '_']
    assert underscores, key             # mk_ at least
    field = page.locator('#api-key').evaluate(KEY_FIELD)
    assert 'monospace' in field['font'], field
    assert field['inner'] >= 1.2 * field['size'], field      # the field's text is not cut below either


# The site's name and icon ----------------------------------------------------

def test_the_site_name_is_in_the_title_and_header_and_the_icon_is_an_svg_served_here(server, tabs):
    tab = tabs(viewport=DESKTOP)
    page = tab.page
    tab.open(server, '/')
    assert_site_name(page, 'Open jobs')
    icon = page.locator('head link[rel="icon"]')
    assert (icon.get_attribute('href'), icon.get_attribute('type')) == ('/static/favicon.svg', 'image/svg+xml')
    answer = tab.context.request.get(server.url + icon.get_attribute('href'))
    assert (answer.status, answer.headers['content-type']) == (200, 'image/svg+xml')
    assert answer.body().startswith(b'<svg')
    # The page's CSP lets it load, and it draws: a picture with a size.
    size = page.evaluate('''async href => {
        const picture = new Image(); picture.src = href; await picture.decode();
        return [picture.naturalWidth, picture.naturalHeight];
    }''', '/static/favicon.svg')
    assert size[0] > 0 and size[0] == size[1], size
    for path, title in (('/agents', 'Agents'), ('/signin', 'Sign in')):
        tab.open(server, path)
        assert_site_name(page, title)
    assert tab.errors == []

    icon_tab = tabs(viewport={'width': 96, 'height': 96})
    icon_tab.open(server, '/static/favicon.svg')
    element_screenshot(icon_tab.page, 'favicon')


# The new key -----------------------------------------------------------------

def test_a_new_key_is_shown_whole_in_a_code_block_and_its_button_copies_it(server, tabs):
    tab = tabs(viewport=DESKTOP, permissions=['clipboard-read', 'clipboard-write'])
    page = tab.page
    key = sign_up(tab, server, 'Newcomer Ada')
    assert re.fullmatch(r'mk_[A-Za-z0-9_-]{43}', key), key
    assert_site_name(page, 'Your API key')
    assert_key_shown_whole(page, key, DESKTOP['width'])
    copy = page.locator('button[data-copy="api-key"]')
    expect(copy).to_be_visible()                     # forms.js shows it
    expect(copy).to_have_text('Copy the key')
    page.evaluate('navigator.clipboard.writeText("something else")')
    copy.click()
    expect(copy).to_have_text('Copied')
    assert page.evaluate('navigator.clipboard.readText()') == key
    assert tab.errors == []
    screenshot(page, 'signed-up')

    phone = tabs(**PHONE_OPTIONS, permissions=['clipboard-read', 'clipboard-write'])
    key = sign_up(phone, server, 'Newcomer Bo')
    assert_key_shown_whole(phone.page, key, PHONE['width'])
    copy = phone.page.locator('button[data-copy="api-key"]')
    expect(copy).to_be_visible()
    assert not overlap(copy.bounding_box(), phone.page.locator('#api-key').bounding_box())
    copy.tap()
    expect(copy).to_have_text('Copied')
    assert phone.page.evaluate('navigator.clipboard.readText()') == key
    assert scroll_width(phone) <= PHONE['width']
    screenshot(phone.page, 'signed-up-phone')

    plain = tabs(viewport=DESKTOP, java_script_enabled=False)       # no script: no button that would do nothing
    key = sign_up(plain, server, 'Newcomer Cy')
    assert plain.page.locator('p.key-text code').inner_text() == key
    expect(plain.page.locator('button[data-copy="api-key"]')).to_be_hidden()


# The post form's extra options -----------------------------------------------

def test_the_post_forms_options_are_spaced_and_each_competition_mode_is_explained_in_a_sentence(server, tabs):
    for options, name in (({'viewport': DESKTOP}, 'post-form'), (PHONE_OPTIONS, 'post-form-phone')):
        tab = tabs(**options)
        page, width = tab.page, options['viewport']['width']
        sign_up(tab, server, 'Poster')
        tab.open(server, '/jobs/new')
        assert_site_name(page, 'Post a job')
        details = page.locator('details.options')
        expect(details).not_to_have_attribute('open', '')
        details.locator('summary').click()
        expect(details).to_have_attribute('open', '')

        modes = page.locator('#competitionMode option').evaluate_all('options => options.map(o => o.value)')
        assert modes == ['first-wins', 'best-wins', 'all-paid']
        hints = page.locator('#competitionMode-hint > li')
        assert hints.locator('strong').all_inner_texts() == modes      # each mode once, in the select's order
        for mode, text in zip(modes, hints.all_inner_texts()):
            assert re.fullmatch(rf'{mode}: [^.:]+\.', text), text       # one sentence
        hint_boxes = boxes(hints)
        assert len(hint_boxes) == 3
        assert all(not overlap(a, b) for at, a in enumerate(hint_boxes) for b in hint_boxes[at + 1:])

        # Every row of the options (label, field, the modes' list) below the one before, and a label at least
        # 8 px below the field before it: nothing overlaps, nothing is crammed, nothing leaves the screen.
        rows = details.locator(':scope > :is(summary, label, input, select, textarea, ul)')
        tags = rows.evaluate_all('rows => rows.map(row => row.tagName.toLowerCase())')
        placed = boxes(rows)
        assert len(placed) == len(tags) == 16, tags     # the summary, 7 labels, 7 fields, the modes
        for (above, below), (tag_above, tag_below) in zip(zip(placed, placed[1:]), zip(tags, tags[1:])):
            assert below['y'] >= above['y'] + above['height'] - 0.5, (tag_above, above, tag_below, below)
            if tag_below == 'label' and tag_above != 'summary':
                assert below['y'] - (above['y'] + above['height']) >= 8, (tag_above, above, tag_below, below)
        assert all(not overlap(a, b) for at, a in enumerate(placed) for b in placed[at + 1:])
        assert all(box['x'] >= 0 and box['x'] + box['width'] <= width for box in placed), placed
        assert scroll_width(tab) <= width
        assert tab.errors == []
        screenshot(page, name)
        element_screenshot(details, f'{name}-options')


# The board by status ---------------------------------------------------------

def test_the_board_shows_each_status_or_all_and_streams_only_open_jobs(server, tabs):
    tab = tabs(viewport=DESKTOP)
    page = tab.page
    tab.open_board(server, '/')         # the open board: its stream is connected
    assert page.locator('select[name=status] option').evaluate_all('options => options.map(o => o.value)') == \
        BOARD_STATUSES
    assert page.locator('select[name=status]').input_value() == 'open'

    tab.open(server, '/?status=any')
    everything = api(server, '/api/jobs', limit=100)['jobs']
    statuses = {job['status'] for job in everything}
    assert {'open', 'claimed', 'delivered', 'completed', 'cancelled', 'disputed'} <= statuses, statuses
    assert_site_name(page, 'All jobs')
    assert page.locator('h1').inner_text() == 'All jobs'
    assert tab.rows() == [shown_as_row(job) for job in everything]
    assert page.locator('#jobs > li.job .meta .status').evaluate_all(TEXTS) == [job['status'] for job in everything]
    assert page.locator('p.count').inner_text() == f'{len(everything)} jobs.'
    assert page.locator('select[name=status]').input_value() == 'any'
    assert page.locator('#jobs').get_attribute('data-stream') is None       # the stream brings open jobs only
    assert page.locator('script[src="/static/board.js"]').count() == 0
    assert page.evaluate('window.__streamEvents') == []
    screenshot(page, 'board-all')

    page.locator('select[name=status]').select_option('cancelled')
    with page.expect_navigation():
        page.get_by_role('button', name='Show').click()
    assert parse_qs(urlparse(page.url).query).get('status') == ['cancelled'], page.url
    cancelled = api(server, '/api/jobs', status='cancelled', limit=100)['jobs']
    assert [job['title'] for job in cancelled] == ['Survey of vector databases']
    assert tab.rows() == [shown_as_row(job) for job in cancelled]
    assert page.locator('#jobs > li.job .meta .status').evaluate_all(TEXTS) == ['cancelled']
    assert (page.locator('h1').inner_text(), page.locator('p.count').inner_text()) == \
        ('Jobs cancelled', '1 cancelled job.')
    assert page.locator('select[name=status]').input_value() == 'cancelled'
    assert page.locator('#jobs').get_attribute('data-stream') is None

    page.locator('select[name=status]').select_option('open')
    with page.expect_navigation():
        page.get_by_role('button', name='Show').click()
    assert parse_qs(urlparse(page.url).query).get('status') == ['open'], page.url
    assert tab.rows() == [shown_as_row(job) for job in api(server, '/api/jobs', status='open', limit=100)['jobs']]
    assert page.locator('#jobs').get_attribute('data-stream')
    assert page.locator('#jobs > li.job .meta .status').count() == 0          # all open: no status to tell
    wait_until(page, 'window.__streamEvents.length > 0')      # an open board's stream connects
    assert tab.errors == []


# Transaction hashes ------------------------------------------------------------

# Each transaction cell: its text, its title, its link, on how many lines the link is drawn (0: not shown), its right.
TX_CELLS = '''cells => cells.map(cell => {
    const link = cell.querySelector('a');
    return {text: cell.textContent, title: cell.title, href: link && link.href,
            lines: link ? link.getClientRects().length : 0, right: cell.getBoundingClientRect().right};
})'''

# Every word of the cells shown, with the number of boxes it is drawn in (1: on one line, whole).
WORDS = '''body => {
    const words = [], range = document.createRange();
    for (const cell of body.querySelectorAll('td')) {
        if (!cell.getClientRects().length) continue;            // not shown
        const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
        for (let node = walker.nextNode(); node; node = walker.nextNode()) {
            for (const word of node.data.matchAll(/\\S+/g)) {
                range.setStart(node, word.index); range.setEnd(node, word.index + word[0].length);
                words.push([word[0], range.getClientRects().length]);
            }
        }
    }
    return words;
}'''


def test_transaction_hashes_are_short_in_the_payments_table_and_whole_on_hover_and_in_links(server, chain, tabs):
    if chain is None:
        pytest.skip('anvil is not installed: no transaction hashes without a chain (run `make test`)')
    from test_onchain import PRICE, call, funded_job, new_requester, new_worker, pay_escrow
    key = new_requester(server, 'hash-requester')
    job = funded_job(server, key, pay_escrow(chain, PRICE), title='Hashes: index the release notes')
    agent, worker_key, _ = new_worker(server, 'hash-worker')
    claim_id = claim_and_deliver(server, job, agent['id'], worker_key)
    approved = call(server, 'POST', f'/api/jobs/{job["id"]}/verify', {'claimId': claim_id, 'approved': True}, key)
    assert approved.status_code == 200, approved.text
    payments = call(server, 'GET', f'/api/jobs/{job["id"]}').json()['payments']
    hashes = [payment['txHash'] for payment in payments]
    assert [payment['type'] for payment in payments] == ['escrow', 'release'] and all(map(HASH.fullmatch, hashes))

    for options, name in (({'viewport': DESKTOP}, 'job-hashes'), (PHONE_OPTIONS, 'job-hashes-phone')):
        tab = tabs(**options)
        page, width = tab.page, options['viewport']['width']
        tab.open(server, f'/jobs/{job["id"]}')
        cells = page.locator('table.payments td.tx')
        shown = cells.evaluate_all(TX_CELLS)
        assert [(cell['text'], cell['title'], cell['href']) for cell in shown] == [
            (f'{tx_hash[:10]}…{tx_hash[-6:]}', tx_hash, f'{EXPLORER}/tx/{tx_hash}') for tx_hash in hashes]
        table = page.locator('table.payments').bounding_box()
        assert table['x'] + table['width'] <= width
        for cell in shown:
            assert cell['lines'] == 1 and cell['right'] <= table['x'] + table['width'], cell    # one line, inside
        # Found by this test's phone screenshot (fixed): on a phone the table hid its transactions, and its four narrow
        # columns broke words ("escro|w", "confirm|ed"); now each payment is a line or two of whole words, hash too.
        assert [word for word, lines in page.locator('table.payments tbody').evaluate(WORDS) if lines != 1] == []
        if width == DESKTOP['width']:
            cells.first.hover()
            assert page.locator('table.payments td.tx:hover').get_attribute('title') == hashes[0]
        # The timeline's hashes too: shortened as in the table, the whole on hover and in their links.
        links = page.locator('ol.timeline .tx a')
        assert links.evaluate_all(TEXTS) == [f'{tx_hash[:10]}…{tx_hash[-6:]}' for tx_hash in hashes]
        assert page.locator('ol.timeline .tx').evaluate_all('spans => spans.map(s => s.title)') == hashes
        assert [links.nth(at).get_attribute('href') for at in range(2)] == [f'{EXPLORER}/tx/{h}' for h in hashes]
        assert scroll_width(tab) <= width
        assert tab.errors == []
        screenshot(page, name)
        element_screenshot(page.locator('table.payments'), f'{name}-table')


def test_the_api_docs_page_says_a_429_in_words(server, tabs):
    """/api/docs when its document is refused for its rate (an older server, a proxy's limit), and a try-it-out call
    refused: "rate limited, try again in N s", never Swagger UI's "does not specify a valid version field"."""
    tab = tabs()
    page = tab.page

    def refused(seconds):
        body = {'error': 'Too many requests.', 'code': 'rate_limited', 'status': 429, 'retryAfter': seconds}
        return lambda route: route.fulfill(status=429, json=body, headers={'Retry-After': str(seconds)})

    page.route('**/api/openapi.json', refused(42))
    tab.open(server, '/api/docs')
    expect(page.locator('[role=alert]')).to_have_text('The API document could not be read: rate limited, try again '
                                                      'in 42 s.')
    assert 'version field' not in page.locator('body').inner_text()
    page.unroute('**/api/openapi.json')
    page.route('**/api/health', refused(7))
    tab.open(server, '/api/docs')
    page.locator('#operations-Discovery-get_api_health, [id$="get_api_health"]').first.click()
    page.get_by_role('button', name='Try it out').click()
    page.get_by_role('button', name='Execute').click()
    expect(page.locator('.live-responses-table')).to_contain_text('rate limited, try again in 7 s')
    element_screenshot(page.locator('.live-responses-table'), 'api-docs-429')
