"""The job board for people: the HTML pages (docs/pages.md "The job board: pages for people").

GET / (open jobs, filters, search, the live stream's URL), /jobs/:id (what is asked, the timeline, claims,
payments, block-explorer links on chain), /agents and /agents/:id (leaderboard, profile, the reputation
chart), /disputes/:id, /arbitrators, the stylesheet, the pages' rate-limit bucket, and escaping of every
piece of user text. Everything runs in-process through the WSGI app; the HTML is parsed with html.parser.
Time is moved with mp.CLOCK where the page shows times, so that every time shown is known exactly.
"""

from datetime import datetime, timedelta, timezone
from html.parser import HTMLParser

import pytest
import responses

import marketplace as mp
import pages
import wiring
from conftest import ADMIN_KEY, Client, Market, auto_verify, expire, get_agent, job_body, make_account, make_agent
from test_disputes import (make_arbitrators, open_dispute, register_arbitrator, resolve, set_arbitrator, set_reputation,
                           vote)

HTML = 'text/html; charset=utf-8'
T0 = datetime(2030, 1, 2, 3, 4, tzinfo=timezone.utc)      # the frozen clock's start: '2030-01-02 03:04 UTC'
UNKNOWN_ID = '00000000-0000-4000-8000-000000000000'
XSS_IMG = '<img src=x onerror=alert(1)>'
XSS_SCRIPT = '<script>alert(1)</script>'


# An HTML tree from html.parser ------------------------------------------------

VOID = {'area', 'base', 'br', 'col', 'embed', 'hr', 'img', 'input', 'link', 'meta', 'source', 'track', 'wbr'}


class Node:
    """An element: tag, attrs, children (Nodes and strings)."""

    def __init__(self, tag, attrs, parent=None):
        self.tag, self.attrs, self.parent, self.children = tag, dict(attrs), parent, []

    def text(self):
        """All the text inside, whitespace collapsed."""
        def texts(node):
            for child in node.children:
                yield from [child] if isinstance(child, str) else texts(child)
        return ' '.join(''.join(texts(self)).split())

    def iter(self):
        for child in self.children:
            if isinstance(child, Node):
                yield child
                yield from child.iter()

    def find_all(self, tag, cls=None, **attrs):
        return [node for node in self.iter() if node.tag == tag
                and (cls is None or cls in node.attrs.get('class', '').split())
                and all(node.attrs.get(name) == value for name, value in attrs.items())]

    def find(self, tag, cls=None, **attrs):
        """The one such element (fails if there is none or more than one)."""
        found = self.find_all(tag, cls, **attrs)
        assert len(found) == 1, f'{len(found)} <{tag} class={cls} {attrs}>'
        return found[0]


class TreeBuilder(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = self.current = Node('#document', {})
        self.tags = []          # every start tag, in order

    def handle_starttag(self, tag, attrs):
        node = Node(tag, attrs, self.current)
        self.current.children.append(node)
        self.tags.append(tag)
        if tag not in VOID:
            self.current = node

    def handle_startendtag(self, tag, attrs):
        self.current.children.append(Node(tag, attrs, self.current))
        self.tags.append(tag)

    def handle_endtag(self, tag):
        node = self.current
        while node is not self.root and node.tag != tag:
            node = node.parent
        if node is not self.root:
            self.current = node.parent

    def handle_data(self, data):
        self.current.children.append(data)


class Page:
    """One answered page: status, headers, the HTML text, its tree (`root`) and its start tags."""

    def __init__(self, answer):
        self.status, self.headers = answer.status, answer.headers
        assert isinstance(answer.body, bytes), answer
        self.html = answer.body.decode('utf-8')
        builder = TreeBuilder()
        builder.feed(self.html)
        builder.close()
        self.root, self.tags = builder.root, builder.tags

    def find(self, tag, cls=None, **attrs):
        return self.root.find(tag, cls, **attrs)

    def find_all(self, tag, cls=None, **attrs):
        return self.root.find_all(tag, cls, **attrs)


# Helpers ---------------------------------------------------------------------

def header(answer, name):
    """A response header, whatever the case of its name."""
    return {key.lower(): value for key, value in answer.headers.items()}.get(name.lower())


def get_page(client, path, status=200):
    """GET an HTML page, checking its status and Content-Type."""
    answer = client.get(path)
    assert answer.status == status, answer
    assert answer.headers['Content-Type'] == HTML, answer.headers
    return Page(answer)


def at(minutes=0, hours=0):
    """A time after T0 as the pages show it."""
    return mp.when(mp.iso(T0 + timedelta(minutes=minutes, hours=hours)))


@pytest.fixture
def clock(real_clock):
    """The clock stands at T0; a test moves it with clock.advance()."""
    real_clock.set(T0)
    return real_clock


def board_rows(page):
    """The board's jobs: (title, link, category, pay, deadline shown, deadline attribute)."""
    rows = []
    for item in page.find('ol', id='jobs').find_all('li', 'job'):
        title, due = item.find('a', 'title'), item.find('time', 'deadline')
        rows.append((title.text(), title.attrs['href'], item.find('span', 'category').text(),
                     item.find('span', 'pay').text(), due.text(), due.attrs['datetime']))
    return rows


def board_titles(client, query=''):
    return [row[0] for row in board_rows(get_page(client, '/' + query))]


def timeline(page):
    """The job page's timeline: [{what, when, at, text, links, tx}]."""
    events = []
    for item in page.find('ol', 'timeline').find_all('li'):
        moment = item.find('time')
        tx = item.find_all('span', 'tx')
        events.append({'what': item.find('strong').text(), 'when': moment.text(), 'at': moment.attrs['datetime'],
                       'text': item.text(), 'links': [a.attrs['href'] for a in item.find_all('a')],
                       'tx': tx[0] if tx else None})
    return events


def whats(page):
    return [event['what'] for event in timeline(page)]


def payment_rows(page):
    """The payments table: ([cell texts], link of the transaction cell or None) per row."""
    rows = []
    for row in page.find('table', 'payments').find('tbody').find_all('tr'):
        links = row.find('td', 'tx').find_all('a')
        rows.append(([cell.text() for cell in row.find_all('td')], links[0].attrs['href'] if links else None))
    return rows


def table_rows(page):
    return [[cell.text() for cell in row.find_all('td')] for row in page.find('tbody').find_all('tr')]


def verify(market, job, claim, approved, reason=None):
    body = {'claimId': claim['id'], 'approved': approved, **({'reason': reason} if reason else {})}
    answer = market.client.post(f'/api/jobs/{job["id"]}/verify', body, key=market.requester_key)
    assert answer.status == 200, answer
    return answer.json


def deliver(market, job, claim, url='https://example.com/out', notes=None, key=None):
    deliverable = {'type': 'url', 'url': url, **({'notes': notes} if notes else {})}
    answer = market.client.post(f'/api/jobs/{job["id"]}/deliver', {'claimId': claim['id'], 'deliverable': deliverable},
                                key=key or market.worker_key)
    assert answer.status == 200, answer
    return answer.json['claim']


def assert_frame(page, title):
    """What every page has: one <h1>, its <title>, the viewport meta tag, the stylesheet."""
    assert len(page.find_all('h1')) == 1, page.html
    assert page.find('title').text() == f'{title} · Job Marketplace'
    assert page.find('meta', name='viewport').attrs['content'] == 'width=device-width, initial-scale=1'
    assert page.find('link', rel='stylesheet').attrs['href'] == '/static/style.css'
    assert page.html.startswith('<!doctype html>')


# The board -------------------------------------------------------------------

def test_board_lists_only_open_jobs_newest_first_with_title_category_pay_and_deadline(market, client):
    first = market.job(title='Write the parser', category='code', paymentAmount='25',
                       deadline='2031-05-06T07:08:09Z')
    second = market.job(title='Label the images', category='data', paymentAmount='30.5',
                        deadline='2031-06-07T23:59:59.999Z')
    claimed = market.job(title='Already claimed')
    market.claim(claimed)
    cancelled = market.job(title='Called off')
    assert client.post(f'/api/jobs/{cancelled["id"]}/cancel', key=market.requester_key).status == 200
    third = market.job(title='Summarise the paper', category='research', paymentAmount='1000000.00',
                       deadline='2032-01-01T00:00:00Z')

    page = get_page(client, '/')
    assert board_rows(page) == [
        ('Summarise the paper', f'/jobs/{third["id"]}', 'research', '1000000.00 USDC', 'due 2032-01-01 00:00 UTC',
         '2032-01-01T00:00:00.000Z'),
        ('Label the images', f'/jobs/{second["id"]}', 'data', '30.50 USDC', 'due 2031-06-07 23:59 UTC',
         '2031-06-07T23:59:59.999Z'),
        ('Write the parser', f'/jobs/{first["id"]}', 'code', '25.00 USDC', 'due 2031-05-06 07:08 UTC',
         '2031-05-06T07:08:09.000Z')]
    assert [item.attrs['data-id'] for item in page.find('ol', id='jobs').find_all('li')] == \
        [third['id'], second['id'], first['id']]
    assert page.find('p', 'count').text() == '3 open jobs.'
    assert page.find('span', id='total').text() == '3'
    assert page.find_all('p', id='empty') == []
    assert page.find('h1').text() == 'Open jobs'


def test_the_board_shows_another_status_or_every_one_without_a_stream(market, client):
    market.job(title='Still open')
    claimed = market.job(title='Already claimed')
    market.claim(claimed)
    cancelled = market.job(title='Called off')
    assert client.post(f'/api/jobs/{cancelled["id"]}/cancel', key=market.requester_key).status == 200
    page = get_page(client, '/?status=cancelled')
    assert [row[0] for row in board_rows(page)] == ['Called off']
    assert (page.find('h1').text(), page.find('p', 'count').text()) == ('Jobs cancelled', '1 cancelled job.')
    assert 'data-stream' not in page.find('ol', id='jobs').attrs      # the stream brings open jobs only
    page = get_page(client, '/?status=any')
    assert [row[0] for row in board_rows(page)] == ['Called off', 'Already claimed', 'Still open']
    assert (page.find('h1').text(), page.find('p', 'count').text()) == ('All jobs', '3 jobs.')
    page = get_page(client, '/?status=claimed')
    assert [row[0] for row in board_rows(page)] == ['Already claimed']
    get_page(client, '/?status=nonsense', status=400)          # as the board's other filters


def test_board_count_line_singular_empty_and_capped(market, client):
    page = get_page(client, '/')
    assert page.find('p', 'count').text() == '0 open jobs.'
    assert page.find('p', id='empty').text() == 'No open job matches.'
    market.job(title='Only one')
    assert get_page(client, '/').find('p', 'count').text() == '1 open job.'
    for number in range(2, 52):
        market.job(title=f'Job number {number}')
    page = get_page(client, '/')
    assert page.find('p', 'count').text() == '51 open jobs, showing the newest 50.'
    titles = [row[0] for row in board_rows(page)]
    assert len(titles) == 50 and titles[0] == 'Job number 51' and titles[-1] == 'Job number 2'


@pytest.fixture
def filtered(market):
    """Four open jobs across categories, pay and words: {title: job}."""
    jobs = [market.job(title='Port the CLI to Rust', category='code', paymentAmount='25.00'),
            market.job(title='Clean the sales spreadsheet', category='data', paymentAmount='30.00'),
            market.job(title='Benchmark the Rust parser', category='code', paymentAmount='45.00'),
            market.job(title='Draw a logo', category='design', paymentAmount='29.99')]
    return {job['title']: job for job in jobs}


def test_board_filters_narrow_the_list_exactly(client, filtered):
    assert board_titles(client, '?category=code') == ['Benchmark the Rust parser', 'Port the CLI to Rust']
    assert board_titles(client, '?min_pay=30') == ['Benchmark the Rust parser', 'Clean the sales spreadsheet']
    assert board_titles(client, '?min_pay=29.99') == ['Draw a logo', 'Benchmark the Rust parser',
                                                      'Clean the sales spreadsheet']
    assert board_titles(client, '?q=spreadsheet') == ['Clean the sales spreadsheet']
    assert board_titles(client, '?q=rust') == ['Benchmark the Rust parser', 'Port the CLI to Rust']
    assert board_titles(client, '?category=code&min_pay=30') == ['Benchmark the Rust parser']
    assert board_titles(client, '?q=rust&category=data') == []
    assert board_titles(client, '?category=&min_pay=') == ['Draw a logo', 'Benchmark the Rust parser',
                                                          'Clean the sales spreadsheet', 'Port the CLI to Rust']
    page = get_page(client, '/?q=spreadsheet')
    assert page.find('p', 'count').text() == '1 open job matching "spreadsheet".'
    assert get_page(client, '/?category=code').find('p', 'count').text() == '2 open jobs.'


def test_board_stream_url_follows_the_filters_and_is_absent_when_searching(client, filtered, clock):
    def stream(query):
        page = get_page(client, '/' + query)
        return page.find('ol', id='jobs').attrs.get('data-stream'), page.tags.count('script')

    # The stream replays what is posted from just before the board was listed (none is missed meanwhile).
    since = 'since=' + mp.iso(T0 - timedelta(milliseconds=1)).replace(':', '%3A')
    assert since == 'since=2030-01-02T03%3A03%3A59.999Z'
    assert stream('') == ('/api/jobs/stream?' + since, 1)
    assert stream('?category=code') == ('/api/jobs/stream?categories=code&' + since, 1)
    assert stream('?min_pay=30') == ('/api/jobs/stream?min_pay=30.00&' + since, 1)
    assert stream('?category=data&min_pay=12.5') == ('/api/jobs/stream?categories=data&min_pay=12.50&' + since, 1)
    assert stream('?q=rust') == (None, 0)
    assert stream('?q=rust&category=code&min_pay=1') == (None, 0)
    assert 'data-stream' not in get_page(client, '/?q=rust').html


def test_board_form_keeps_the_chosen_values(client, filtered):
    page = get_page(client, '/?q=rust&category=code&min_pay=30')
    form = page.find('form', 'filters')
    assert (form.attrs['method'], form.attrs['action']) == ('get', '/')
    assert form.find('input', name='q').attrs['value'] == 'rust'
    assert form.find('input', name='min_pay').attrs['value'] == '30'
    options = form.find('select', name='category').find_all('option')
    assert [option.attrs['value'] for option in options] == ['', *mp.CATEGORIES]
    assert [option.attrs['value'] for option in options if 'selected' in option.attrs] == ['code']

    plain = get_page(client, '/').find('form', 'filters')
    assert plain.find('input', name='q').attrs['value'] == ''
    assert plain.find('input', name='min_pay').attrs['value'] == ''
    assert [o for o in plain.find('select', name='category').find_all('option') if 'selected' in o.attrs] == []


@pytest.mark.parametrize('query, message', [
    ('?min_pay=abc', 'min_pay must be a number of at least 0, such as 10.5.'),
    ('?min_pay=-1', 'min_pay must be a number of at least 0, such as 10.5.'),
    ('?min_pay=NaN', 'min_pay must be a number of at least 0, such as 10.5.'),
    ('?category=nope', 'category must be one of code, content, data, research, design, custom.'),
])
def test_a_bad_filter_is_a_400_html_page_with_the_message(client, query, message):
    page = get_page(client, '/' + query, status=400)
    assert page.find('h1').text() == '400 Bad Request'
    assert page.find('p', 'error').text() == message
    assert [a.text() for a in page.find_all('a', href='/')] == ['Job Marketplace', 'Jobs', 'Back to the open jobs']
    assert_frame(page, '400 Bad Request')


# Found by this test (fixed): the board read q as WSGI's latin-1 text, so 'café' came out as 'cafÃ©'.
def test_board_search_with_non_ascii_words_finds_the_job_as_the_api_does(market, client):
    job = market.job(title='Menu for the café')
    market.job(title='Something else')
    assert client.get('/api/jobs/search?q=caf%C3%A9').json['total'] == 1
    page = get_page(client, '/?q=caf%C3%A9')
    assert page.find('form', 'filters').find('input', name='q').attrs['value'] == 'café'
    assert [row[1] for row in board_rows(page)] == [f'/jobs/{job["id"]}']
    assert page.find('p', 'count').text() == '1 open job matching "café".'


# Found by this test (fixed): a search with no word in it listed every open job as "matching".
def test_board_search_without_any_word_matches_nothing_as_the_api_does(market, client):
    market.job(title='Port the CLI to Rust')
    assert client.get('/api/jobs/search?q=%21%21%21').json['total'] == 0
    page = get_page(client, '/?q=%21%21%21')
    assert board_rows(page) == []
    assert page.find('p', 'count').text() == '0 open jobs matching "!!!".'


# Escaping --------------------------------------------------------------------

def test_user_text_is_escaped_on_every_page(app, market, client):
    job = market.job(title=XSS_SCRIPT, description=f'{XSS_IMG} "\'&',
                     requirements={'note': XSS_IMG, '<img src=y>': 'key', 'list': [XSS_IMG, '"\'&']},
                     acceptanceCriteria=[{'type': XSS_IMG, 'check': '"\'&'}])
    _, bold_key = make_account(client, 'bold owner')
    bold, _ = make_agent(client, bold_key, name='<b>bold</b>', description='<b>about</b>',
                         capabilities={'categories': ['code'], 'languages': ['<b>py</b>']},
                         pricing={'<img src=z>': '<b>free</b>'})
    claim = market.claim(job, agent=bold, key=bold_key)
    deliver(market, job, claim, url="https://example.com/a'b", notes='<script>alert(2)</script>', key=bold_key)
    # The pages show a deliverable's type only (its url and notes are private): a stored url never shows.
    app.service.db.execute('''UPDATE claims SET deliverable = json_set(deliverable, '$.url', :url, '$.type', :type)
                              WHERE id = :id''',
                           {'url': 'https://example.com/a"b\'c<script>x', 'type': XSS_IMG[:50], 'id': claim['id']})
    account, arbiter_key = make_account(client, 'arbiter owner')
    arbiter = register_arbitrator(client, ADMIN_KEY, name='<b>judge</b>', accountId=account['id']).json['arbitrator']
    arbiter = set_arbitrator(client, arbiter, status='active', trusted=True)
    make_arbitrators(client, 2)         # with the judge, the dispute's panel
    dispute = open_dispute(client, job, claim, market.requester_key, reason='<script>alert(3)</script>')
    assert arbiter['id'] in dispute['panel']
    assert vote(client, dispute, arbiter, arbiter_key, 'worker', '<script>alert(4)</script>').status == 201

    listed = market.job(title=XSS_SCRIPT)
    other = market.job(title='Plain job')
    other_claim = market.claim(other, agent=bold, key=bold_key)
    deliver(market, other, other_claim, key=bold_key)
    verify(market, other, other_claim, False, reason='<script>alert(5)</script>')

    page_paths = {
        '/': True, '/?q=%3Cscript%3Ealert%3C%2Fscript%3E': False, '/?q=%22%3E%3Cscript%3Ealert(6)': False,
        f'/jobs/{job["id"]}': False, f'/jobs/{other["id"]}': False, '/agents': False,
        f'/agents/{bold["id"]}': False, f'/disputes/{dispute["id"]}': False, '/arbitrators': False}
    shown = {}
    for path, live in page_paths.items():
        page = shown[path] = get_page(client, path)
        assert page.tags.count('script') == (1 if live else 0), path
        assert 'img' not in page.tags and 'b' not in page.tags, (path, page.tags)
        for raw in ('<script>alert', '<img', '<b>', '"\'&'):
            assert raw not in page.html, (path, raw)

    def has(path, *fragments):
        for fragment in fragments:
            assert fragment in shown[path].html, (path, fragment)

    escaped_script = '&lt;script&gt;alert(1)&lt;/script&gt;'
    escaped_bold = '&lt;b&gt;bold&lt;/b&gt;'
    has('/', f'<a class="title" href="/jobs/{listed["id"]}">{escaped_script}</a>')
    has('/?q=%3Cscript%3Ealert%3C%2Fscript%3E', 'value="&lt;script&gt;alert&lt;/script&gt;"',
        '<span id="noun">job</span> matching &quot;&lt;script&gt;alert&lt;/script&gt;&quot;.', escaped_script)
    has('/?q=%22%3E%3Cscript%3Ealert(6)', 'value="&quot;&gt;&lt;script&gt;alert(6)"')
    has(f'/jobs/{job["id"]}', f'<h1>{escaped_script}</h1>', f'<title>{escaped_script} · Job Marketplace</title>',
        '<p class="description">&lt;img src=x onerror=alert(1)&gt; &quot;&#039;&amp;</p>',
        '<dt>note</dt><dd>&lt;img src=x onerror=alert(1)&gt;</dd>', '<dt>&lt;img src=y&gt;</dt><dd>key</dd>',
        '<dd>&lt;img src=x onerror=alert(1)&gt;, &quot;&#039;&amp;</dd>',
        '<span class="tag">&lt;img src=x onerror=alert(1)&gt;</span> &quot;&#039;&amp;</li>',
        f'">{escaped_bold}</a>', f'by {escaped_bold}',
        '<p>Delivered (&lt;img src=x onerror=alert(1)&gt;), private', '&lt;script&gt;alert(3)&lt;/script&gt;')
    has(f'/jobs/{other["id"]}', 'Verdict: &lt;script&gt;alert(5)&lt;/script&gt;',
        f'{escaped_bold}&#039;s delivery: &lt;script&gt;alert(5)&lt;/script&gt;')
    has('/agents', f'<a href="/agents/{bold["id"]}">{escaped_bold}</a>')
    has(f'/agents/{bold["id"]}', f'<h1>{escaped_bold}</h1>', '<p class="description">&lt;b&gt;about&lt;/b&gt;</p>',
        '<dd>code</dd>', '<dd>&lt;b&gt;py&lt;/b&gt;</dd>',
        '<dt>pricing: &lt;img src=z&gt;</dt><dd>&lt;b&gt;free&lt;/b&gt;</dd>',
        f'<a href="/jobs/{job["id"]}">{escaped_script}</a>')
    has(f'/disputes/{dispute["id"]}', '<p class="description">&lt;script&gt;alert(3)&lt;/script&gt;</p>',
        f'">{escaped_bold}</a>', '<strong>&lt;b&gt;judge&lt;/b&gt;</strong>',
        '<span class="reasoning">&lt;script&gt;alert(4)&lt;/script&gt;</span>',
        f'<title>Dispute: {escaped_script} · Job Marketplace</title>',
        'Delivered (&lt;img src=x onerror=alert(1)&gt;), private')
    has('/arbitrators', '<td>&lt;b&gt;judge&lt;/b&gt;</td>')
    assert shown[f'/disputes/{dispute["id"]}'].find('ul', 'panel').find_all('li')[0].text() == '<b>judge</b> voted'
    # what the parser reads back is the user's text, unchanged
    assert shown[f'/jobs/{job["id"]}'].find('h1').text() == XSS_SCRIPT
    assert shown[f'/agents/{bold["id"]}'].find('h1').text() == '<b>bold</b>'
    assert shown[f'/jobs/{job["id"]}'].find('div', 'deliverable').find_all('a') == []
    for path, page in shown.items():
        assert 'example.com/a' not in page.html and 'alert(2)' not in page.html, path


# The job page ----------------------------------------------------------------

def test_job_page_timeline_claims_and_payments_of_an_approved_job(market, client, clock):
    job = market.job(title='Timeline job', description='Do the thing.', paymentAmount='25.00',
                     requirements={'language': 'python', 'tools': ['pytest', 'ruff']},
                     acceptanceCriteria=[{'type': 'test', 'check': 'pytest passes'}])
    clock.advance(minutes=1)
    claim = market.claim(job)
    clock.advance(minutes=1)
    deliver(market, job, claim, url='https://example.com/pr/7', notes='See the PR.')
    clock.advance(minutes=1)
    verify(market, job, claim, True, reason='Looks right.')
    detail = market.get_job(job)
    shown_claim = detail['claims'][0]

    page = get_page(client, f'/jobs/{job["id"]}')
    assert_frame(page, 'Timeline job')
    assert page.find('h1').text() == 'Timeline job'
    assert page.find('p', 'facts').text() == (
        f'completed code 25.00 USDC on base · due {at(hours=48)} · first-wins, 1 worker')
    assert page.find('p', 'description').text() == 'Do the thing.'
    assert [(dt.text(), dd.text()) for dt, dd in zip(page.find('dl', 'pairs').find_all('dt'),
                                                     page.find('dl', 'pairs').find_all('dd'))] == \
        [('language', 'python'), ('tools', 'pytest, ruff')]
    assert [li.text() for li in page.find_all('section')[0].find('ul').find_all('li')] == ['test pytest passes']

    events = timeline(page)
    assert [(e['what'], e['when']) for e in events] == [
        ('Posted', at(0)), ('Escrow locked', at(0)), ('Claimed', at(1)), ('Delivered', at(2)), ('Approved', at(3)),
        ('Paid to the worker', at(3))]
    assert [e['at'] for e in events] == [detail['job']['createdAt'], detail['payments'][0]['createdAt'],
                                         shown_claim['createdAt'], shown_claim['deliveredAt'],
                                         shown_claim['verifiedAt'], detail['payments'][1]['createdAt']]
    assert [e['text'] for e in events] == [
        f'{at(0)} Posted — 25.00 USDC, due {at(hours=48)}', f'{at(0)} Escrow locked — 25.00 USDC (simulated)',
        f'{at(1)} Claimed — by worker-agent', f'{at(2)} Delivered — by worker-agent',
        f"{at(3)} Approved — worker-agent's delivery: Looks right.",
        f'{at(3)} Paid to the worker — 25.00 USDC (simulated)']
    assert all(e['links'] == [] and e['tx'] is None for e in events)

    (article,) = page.find_all('article', 'claim')
    agent_link = article.find_all('a')[0]
    assert (agent_link.attrs['href'], agent_link.text()) == (f'/agents/{market.agent["id"]}', 'worker-agent')
    assert article.find('span', 'status').text() == 'approved'
    # The work is private (CONTRACT.md 18): the page says it was delivered, never where, nor the notes.
    assert article.find('div', 'deliverable').find_all('a') == []
    assert article.find('div', 'deliverable').find_all('p')[0].text() == (
        'Delivered (url), private: the API shows it only to the requester, the worker, admins and the arbitrators '
        'of a dispute over it.')
    assert article.find_all('p', 'notes') == []
    assert 'example.com/pr/7' not in page.html and 'See the PR.' not in page.html
    assert article.find('p', 'reason').text() == 'Verdict: Looks right.'

    assert payment_rows(page) == [
        ([at(0), 'escrow', '25.00 USDC', 'simulated', 'ledger only (base)'], None),
        ([at(3), 'release', '25.00 USDC', 'simulated', 'ledger only (base)'], None)]
    assert 'basescan' not in page.html and '/tx/' not in page.html
    assert page.find('p', 'api').find('a').attrs['href'] == f'/api/jobs/{job["id"]}'


def test_job_page_of_a_new_job_has_no_claims_and_only_the_escrow(market, client, clock):
    job = market.job(title='Fresh job', paymentAmount='7.5', paymentCurrency='USD')
    page = get_page(client, f'/jobs/{job["id"]}')
    assert whats(page) == ['Posted', 'Escrow locked']
    assert page.find('p', 'empty').text() == 'No one has claimed this job yet.'
    assert payment_rows(page) == [([at(0), 'escrow', '7.50 USD', 'simulated', 'ledger only (stripe)'], None)]
    assert page.find('p', 'facts').text().startswith('open code 7.50 USD on stripe · due ')


def test_job_page_of_a_rejected_job_shows_rejected_and_refunded(market, client, clock):
    job = market.job(title='Rejected job', paymentAmount='12.34')
    clock.advance(minutes=1)
    claim = market.claim(job)
    clock.advance(minutes=4)
    deliver(market, job, claim)
    clock.advance(minutes=5)
    verify(market, job, claim, False, reason='The tests fail.')
    page = get_page(client, f'/jobs/{job["id"]}')
    assert [(e['what'], e['when']) for e in timeline(page)] == [
        ('Posted', at(0)), ('Escrow locked', at(0)), ('Claimed', at(1)), ('Delivered', at(5)), ('Rejected', at(10)),
        ('Refunded to the requester', at(10))]
    assert timeline(page)[4]['text'] == f"{at(10)} Rejected — worker-agent's delivery: The tests fail."
    assert timeline(page)[5]['text'] == f'{at(10)} Refunded to the requester — 12.34 USDC (simulated)'
    assert page.find('p', 'reason').text() == 'Verdict: The tests fail.'
    assert page.find('article', 'claim').find('span', 'status').text() == 'rejected'
    assert [cells for cells, _ in payment_rows(page)] == [
        [at(0), 'escrow', '12.34 USDC', 'simulated', 'ledger only (base)'],
        [at(10), 'refund', '12.34 USDC', 'simulated', 'ledger only (base)']]


def test_job_page_after_the_verification_window_says_approved_automatically(market, client, clock):
    job = market.job(title='Auto job', verificationWindowHours=24)
    clock.advance(minutes=1)
    claim = market.claim(job)
    clock.advance(minutes=1)
    deliver(market, job, claim)
    clock.advance(hours=23, minutes=59)
    assert auto_verify(client)['claimIds'] == []          # the window is not over yet
    assert whats(get_page(client, f'/jobs/{job["id"]}'))[-1] == 'Delivered'
    clock.advance(minutes=1)
    assert auto_verify(client)['claimIds'] == [claim['id']]
    page = get_page(client, f'/jobs/{job["id"]}')
    assert [(e['what'], e['when']) for e in timeline(page)] == [
        ('Posted', at(0)), ('Escrow locked', at(0)), ('Claimed', at(1)), ('Delivered', at(2)),
        ('Approved automatically', at(hours=24, minutes=2)), ('Paid to the worker', at(hours=24, minutes=2))]
    assert timeline(page)[4]['text'] == f"{at(hours=24, minutes=2)} Approved automatically — worker-agent's delivery"
    assert page.find_all('p', 'reason') == []


def test_job_page_of_an_expired_job_shows_the_expired_claim_the_refund_and_expired(market, client, clock):
    job = market.job(title='Late job', deadline=mp.iso(T0 + timedelta(hours=1)))
    clock.advance(minutes=10)
    market.claim(job)
    clock.advance(hours=1)
    assert expire(client)['jobIds'] == [job['id']]
    page = get_page(client, f'/jobs/{job["id"]}')
    assert [(e['what'], e['when']) for e in timeline(page)] == [
        ('Posted', at(0)), ('Escrow locked', at(0)), ('Claimed', at(10)), ('Claim expired', at(70)),
        ('Refunded to the requester', at(70)), ('Expired', at(70))]
    assert timeline(page)[3]['text'] == f'{at(70)} Claim expired — worker-agent did not deliver'
    assert timeline(page)[5]['text'] == f'{at(70)} Expired'
    assert page.find('p', 'facts').find('span', 'status').text() == 'expired'


def test_job_page_of_a_cancelled_job_shows_cancelled(market, client, clock):
    job = market.job(title='Cancelled job')
    clock.advance(minutes=3)
    assert client.post(f'/api/jobs/{job["id"]}/cancel', key=market.requester_key).status == 200
    page = get_page(client, f'/jobs/{job["id"]}')
    assert [(e['what'], e['when']) for e in timeline(page)] == [
        ('Posted', at(0)), ('Escrow locked', at(0)), ('Refunded to the requester', at(3)), ('Cancelled', at(3))]


def test_job_page_of_a_dispute_decided_by_votes_for_the_worker(market, client, clock):
    arbiters = make_arbitrators(client, 3)
    job = market.job(title='Disputed job', paymentAmount='60.00')
    clock.advance(seconds=1)
    claim = market.claim(job)
    deliver(market, job, claim)
    clock.set(T0 + timedelta(minutes=1))
    dispute = open_dispute(client, job, claim, market.requester_key, reason='It does not build.')
    link = f'/disputes/{dispute["id"]}'

    page = get_page(client, f'/jobs/{job["id"]}')
    assert whats(page) == ['Posted', 'Escrow locked', 'Claimed', 'Delivered', 'Disputed']
    disputed = timeline(page)[4]
    assert (disputed['when'], disputed['text'], disputed['links']) == (
        at(1), f'{at(1)} Disputed — It does not build. the dispute', [link])

    clock.advance(minutes=1)
    for (arbiter, key), choice in zip(arbiters, ('worker', 'requester', 'worker')):
        assert vote(client, dispute, arbiter, key, choice).status == 201
    page = get_page(client, f'/jobs/{job["id"]}')
    events = {e['what']: e for e in timeline(page)}
    assert set(events) == {'Posted', 'Escrow locked', 'Claimed', 'Delivered', 'Disputed', 'Approved',
                           'Dispute decided for the worker', 'Paid to the worker'}
    decided = events['Dispute decided for the worker']
    assert (decided['when'], decided['links']) == (at(2), [link])
    assert decided['text'] == (f'{at(2)} Dispute decided for the worker — Community vote: 2 of 3 arbitrators '
                               'decided for the worker. the dispute')
    order = whats(page)
    assert order.index('Disputed') < order.index('Dispute decided for the worker') < order.index('Paid to the worker')
    assert order[:5] == ['Posted', 'Escrow locked', 'Claimed', 'Delivered', 'Disputed']
    assert [cells[1:4] for cells, _ in payment_rows(page)] == [['escrow', '60.00 USDC', 'simulated'],
                                                               ['release', '60.00 USDC', 'simulated']]


def test_job_page_of_a_dispute_decided_for_the_requester(market, client, clock):
    job = market.job(title='Refused job')
    clock.advance(seconds=1)
    claim = market.claim(job)
    deliver(market, job, claim)
    dispute = open_dispute(client, job, claim, market.requester_key)
    clock.advance(minutes=2)
    assert resolve(client, dispute, 'requester').status == 200
    page = get_page(client, f'/jobs/{job["id"]}')
    events = {e['what']: e for e in timeline(page)}
    assert {'Rejected', 'Dispute decided for the requester', 'Refunded to the requester'} <= set(events)
    assert 'Dispute decided for the worker' not in events and 'Paid to the worker' not in events
    decided = events['Dispute decided for the requester']
    assert (decided['when'], decided['links']) == (at(2), [f'/disputes/{dispute["id"]}'])
    assert decided['text'] == f'{at(2)} Dispute decided for the requester — Decided for the requester. the dispute'


# Found by this test (fixed): steps of one millisecond (one transaction) came out in the order they were
# gathered in, e.g. a dispute's decision after the approval it caused.
def test_timeline_keeps_the_order_of_steps_taken_in_the_same_millisecond(market, client, clock):
    job = market.job(title='All at once')
    claim = market.claim(job)
    deliver(market, job, claim)
    verify(market, job, claim, True)
    page = get_page(client, f'/jobs/{job["id"]}')
    assert whats(page) == ['Posted', 'Escrow locked', 'Claimed', 'Delivered', 'Approved', 'Paid to the worker']


@pytest.mark.parametrize('kind', ['jobs', 'agents', 'disputes'])
def test_unknown_and_malformed_ids_are_html_pages(client, kind):
    noun = kind[:-1]
    page = get_page(client, f'/{kind}/{UNKNOWN_ID}', status=404)
    assert page.find('h1').text() == '404 Not Found'
    assert page.find('p', 'error').text() == f'No {noun} has this id.'
    assert_frame(page, '404 Not Found')
    page = get_page(client, f'/{kind}/not-a-uuid', status=400)
    assert page.find('h1').text() == '400 Bad Request'
    assert page.find('p', 'error').text() == f'The {noun}Id is not a valid UUID.'
    assert_frame(page, '400 Bad Request')


# On chain: links to the block explorer -----------------------------------------

@pytest.fixture
def onchain(tmp_path):
    """start(chain_id): an onchain app on a fake node for that chain: (Market, node). Ledgers checked after."""
    from test_verifier import ESCROW_KEY, NODE_URL, USDC, FakeNode
    apps = []
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        def start(chain_id):
            node = FakeNode(chain_id=chain_id, nonce=7).install(mock)
            app = wiring.make_app(mp.Settings(
                db=str(tmp_path / f'chain{chain_id}.db'), rate_limits='off', admin_key=ADMIN_KEY,
                public_url='http://market.test', allow_private_webhooks=True, rpc_url=NODE_URL, chain_id=chain_id,
                usdc_address=USDC, escrow_key=ESCROW_KEY, confirmations=2))
            apps.append(app)
            return Market(Client(app)), node
        yield start
    for app in apps:
        problems = mp.ledger_problems(app.service.db)
        app.service.close()
        assert problems == []


@pytest.mark.parametrize('chain_id, explorer', [(84532, 'https://sepolia.basescan.org'),
                                                (8453, 'https://basescan.org')])
def test_on_chain_transaction_hashes_link_to_the_chains_explorer(onchain, chain_id, explorer):
    from chain import DEV_KEYS, sign_funding
    from test_verifier import ESCROW
    market, node = onchain(chain_id)
    funding = node.pay(25_000_000)
    signature = sign_funding(DEV_KEYS[1], market.requester['id'], funding, ESCROW, chain_id)     # node.pay's payer
    answer = market.client.post('/api/jobs', dict(job_body(title='Funded job'), escrowTxHash=funding,
                                                  escrowSignature=signature), key=market.requester_key)
    assert answer.status == 201, answer
    job = answer.json['job']
    claim = market.claim(job)
    deliver(market, job, claim)
    release = verify(market, job, claim, True)['payments'][0]
    assert release['type'] == 'release' and release['txHash'].startswith('0x')

    page = get_page(market.client, f'/jobs/{job["id"]}')
    rows = payment_rows(page)
    short = lambda tx_hash: f'{tx_hash[:10]}…{tx_hash[-6:]}'     # noqa: E731 (the table shows a hash short)
    assert [(cells[1], cells[2], cells[3], cells[4], link) for cells, link in rows] == [
        ('escrow', '25.00 USDC', 'confirmed', short(funding), f'{explorer}/tx/{funding}'),
        ('release', '25.00 USDC', 'pending', short(release['txHash']), f'{explorer}/tx/{release["txHash"]}')]
    assert [cell.attrs['title'] for cell in page.find_all('td') if 'tx' in cell.attrs.get('class', '')][:2] == \
        [funding, release['txHash']]              # the whole hash on hover
    events = {e['what']: e for e in timeline(page)}
    for what, tx_hash in (('Escrow locked', funding), ('Paid to the worker', release['txHash'])):
        span = events[what]['tx']
        assert (span.text(), span.attrs['title']) == (short(tx_hash), tx_hash)      # short, and whole on hover
        assert span.find('a').attrs['href'] == f'{explorer}/tx/{tx_hash}'
    funded = [p for p in page.find_all('p') if p.text().startswith('Funded on chain by')]
    assert len(funded) == 1 and funded[0].find('a').attrs['href'] == f'{explorer}/tx/{funding}'
    assert funded[0].text() == f'Funded on chain by {funding}.'
    other = {'https://sepolia.basescan.org', 'https://basescan.org'} - {explorer}
    links = [a.attrs['href'] for a in page.find_all('a') if '/tx/' in a.attrs['href']]
    assert len(links) == 5 and all(link.startswith(explorer + '/tx/0x') for link in links)
    assert not any(link.startswith(tuple(other)) for link in links)


def test_in_simulated_mode_no_explorer_link_appears(market, client):
    job = market.job()
    claim = market.claim(job)
    deliver(market, job, claim)
    verify(market, job, claim, True)
    page = get_page(client, f'/jobs/{job["id"]}')
    assert 'basescan' not in page.html
    assert [a for a in page.find_all('a') if '/tx/' in a.attrs.get('href', '')] == []
    assert page.find_all('span', 'tx') == []
    assert [cells[4] for cells, _ in payment_rows(page)] == ['ledger only (base)', 'ledger only (base)']


# Agents ------------------------------------------------------------------------

def test_agents_leaderboard_by_reputation(market, client, app):
    _, key = make_account(client, 'second owner')
    star, _ = make_agent(client, key, name='star', capabilities={'categories': ['data', 'research']})
    steady, _ = make_agent(client, key, name='steady', capabilities={})
    set_reputation(app, star, 1234)
    job = market.job()
    claim = market.claim(job)
    deliver(market, job, claim)
    verify(market, job, claim, True)              # worker-agent: +1.00
    job = market.job()
    claim = market.claim(job)
    deliver(market, job, claim)
    verify(market, job, claim, False)             # worker-agent: -0.25, 1 of 2 done
    job = market.job()
    market.claim(job, agent=steady, key=key)      # steady: claimed, nothing finished

    page = get_page(client, '/agents')
    assert_frame(page, 'Agents')
    assert page.find('p', 'count').text() == '3 agents, by reputation.'
    assert table_rows(page) == [['1', 'star', '12.34', '0', '0%', 'data, research'],
                                ['2', 'worker-agent', '0.75', '1', '50%', 'code'],
                                ['3', 'steady', '0.00', '0', '0%', '']]
    links = [row.find('a') for row in page.find('tbody').find_all('tr')]
    assert [(a.attrs['href'], a.text()) for a in links] == [(f'/agents/{star["id"]}', 'star'),
                                                            (f'/agents/{market.agent["id"]}', 'worker-agent'),
                                                            (f'/agents/{steady["id"]}', 'steady')]
    api = client.get('/api/agents').json['agents']
    assert [a['name'] for a in api] == ['star', 'worker-agent', 'steady']


def test_agents_page_without_agents(client):
    page = get_page(client, '/agents')
    assert page.find('p', 'count').text() == '0 agents, by reputation.'
    assert page.find('p', 'empty').text() == 'No agent has registered yet.'


def test_agent_page_profile_capabilities_recent_jobs_and_chart(market, client, clock):
    _, key = make_account(client, 'owner')
    wallet = '0x' + 'ab' * 20
    agent, _ = make_agent(client, key, name='Profiled', description='Writes Python.', walletAddress=wallet,
                          capabilities={'categories': ['code', 'data'], 'languages': ['python', 'go']},
                          pricing={'minimumJobValue': 10, 'acceptedCurrencies': ['USDC', 'USD']})
    approved = market.job(title='Approved job')
    claim = market.claim(approved, agent=agent, key=key)
    deliver(market, approved, claim, key=key)
    clock.advance(minutes=1)
    verify(market, approved, claim, True)         # +1.00 -> 1.00
    clock.advance(minutes=1)
    rejected = market.job(title='Rejected job')
    claim = market.claim(rejected, agent=agent, key=key)
    deliver(market, rejected, claim, key=key)
    clock.advance(minutes=1)
    verify(market, rejected, claim, False)        # -0.25 -> 0.75
    clock.advance(minutes=1)
    pending = market.job(title='Pending job')
    market.claim(pending, agent=agent, key=key)

    page = get_page(client, f'/agents/{agent["id"]}')
    assert_frame(page, 'Profiled')
    assert page.find('h1').text() == 'Profiled'
    assert page.find('p', 'description').text() == 'Writes Python.'
    assert page.find('p', 'facts').text() == (
        f'Reputation 0.75 · 1 job done · completion 50% · earned 25.00 · wallet {wallet}')
    pairs = page.find('dl', 'pairs')
    assert [(dt.text(), dd.text()) for dt, dd in zip(pairs.find_all('dt'), pairs.find_all('dd'))] == [
        ('categories', 'code, data'), ('languages', 'python, go'), ('pricing: minimumJobValue', '10'),
        ('pricing: acceptedCurrencies', 'USDC, USD')]
    recent = page.find('ul', 'recent').find_all('li')
    assert [(li.find('a').attrs['href'], li.find('a').text(), li.find('span', 'status').text(), li.find('time').text())
            for li in recent] == [(f'/jobs/{pending["id"]}', 'Pending job', 'claimed', at(4)),
                                  (f'/jobs/{rejected["id"]}', 'Rejected job', 'rejected', at(2)),
                                  (f'/jobs/{approved["id"]}', 'Approved job', 'approved', at(0))]

    history = get_agent(client, agent)['reputationHistory']
    chart = pages.reputation_chart(history)
    assert chart['points'] == '8.0,112.0 300.0,8.0 592.0,34.0'
    assert page.find('polyline').attrs['points'] == chart['points']
    svg = page.find('svg', 'chart')
    assert svg.attrs['viewbox'] == '0 0 600 120'
    assert svg.attrs['aria-label'] == 'Reputation from 0.00 to 0.75 over 2 changes'
    assert page.find('p', 'axis').text() == 'from 0.00 to 0.75 (lowest 0.00, highest 1.00)'
    assert [li.text() for li in page.find('ol', 'history').find_all('li')] == [
        f'{at(3)} -0.25 delivery rejected → 0.75', f'{at(1)} +1.00 delivery approved → 1.00']
    assert page.find('p', 'api').find_all('a')[1].attrs['href'] == f'/api/agents/{agent["id"]}/card'


def test_agent_page_without_history_or_jobs(market, client):
    page = get_page(client, f'/agents/{market.agent["id"]}')
    assert page.find_all('svg') == [] and page.find_all('polyline') == []
    assert [p.text() for p in page.find_all('p', 'empty')] == ['No change yet.', 'No job claimed yet.']
    assert page.find('ul', 'recent').find_all('li') == []


def test_reputation_chart_points_and_labels():
    history = [{'scoreAfter': '1.75', 'delta': '1.00'},      # newest first, as the API gives it
               {'scoreAfter': '0.75', 'delta': '-0.25'},
               {'scoreAfter': '1.00', 'delta': '1.00'}]
    assert pages.reputation_chart(history) == {
        'points': '8.0,112.0 202.7,52.6 397.3,67.4 592.0,8.0', 'width': 600, 'height': 120,
        'low': '0.00', 'high': '1.75', 'first': '0.00', 'last': '1.75'}
    assert pages.reputation_chart([{'scoreAfter': '11.50', 'delta': '1.50'}]) == {
        'points': '8.0,112.0 592.0,8.0', 'width': 600, 'height': 120,
        'low': '10.00', 'high': '11.50', 'first': '10.00', 'last': '11.50'}
    falling = pages.reputation_chart([{'scoreAfter': '4.00', 'delta': '-1.00'}], width=100, height=50, pad=0)
    assert (falling['points'], falling['first'], falling['last']) == ('0.0,0.0 100.0,50.0', '5.00', '4.00')
    flat = pages.reputation_chart([{'scoreAfter': '3.00', 'delta': '0.00'}])
    assert (flat['points'], flat['low'], flat['high']) == ('8.0,8.0 592.0,8.0', '3.00', '3.00')
    assert pages.reputation_chart([]) is None
    assert pages.reputation_chart(None) is None


# Found by this test (fixed): the chart started a new agent whose first delivery was rejected at 0.25 (the
# score before a change cut short at 0.00 cannot be worked out from it; a whole history starts at 0.00).
def test_chart_of_a_new_agent_whose_first_delivery_is_rejected_stays_at_zero(market, client):
    job = market.job()
    claim = market.claim(job)
    deliver(market, job, claim)
    verify(market, job, claim, False)
    history = get_agent(client, market.agent)['reputationHistory']
    assert [(e['delta'], e['scoreAfter']) for e in history] == [('-0.25', '0.00')]
    page = get_page(client, f'/agents/{market.agent["id"]}')
    assert page.find('p', 'axis').text() == 'from 0.00 to 0.00 (lowest 0.00, highest 0.00)'


# Disputes and arbitrators ------------------------------------------------------

def test_dispute_page_before_and_after_the_votes(market, client, clock):
    arbiters = make_arbitrators(client, 3, prefix='judge')       # the only three: the panel
    job = market.job(title='Argued job')
    claim = market.claim(job)
    deliver(market, job, claim, url='https://example.com/result')
    clock.advance(minutes=1)
    dispute = open_dispute(client, job, claim, market.requester_key, reason='Half of it is missing.')

    page = get_page(client, f'/disputes/{dispute["id"]}')
    assert_frame(page, 'Dispute: Argued job')
    crumb = page.find('p', 'crumbs').find('a')
    assert (crumb.attrs['href'], crumb.text()) == (f'/jobs/{job["id"]}', 'Argued job')
    assert page.find('p', 'facts').text() == f'open · opened {at(1)} · 0 of 3 votes'
    assert page.find('p', 'description').text() == 'Half of it is missing.'
    about = [p for p in page.find_all('p') if p.text().startswith('About the delivery of')]
    assert about[0].text() == 'About the delivery of worker-agent (its claim is disputed).'
    assert about[0].find('a').attrs['href'] == f'/agents/{market.agent["id"]}'
    assert [p.text() for p in page.find_all('p', 'empty')] == ['No vote yet.', 'Not decided yet.']
    assert page.find_all('p', 'outcome') == [] and page.find_all('p', 'needs-admin') == []
    assert [li.text() for li in page.find('ul', 'panel').find_all('li')] == \
        ['judge 0 has not voted', 'judge 1 has not voted', 'judge 2 has not voted']

    reasons = ['The tests are red.', 'It works for me.', 'All criteria are met.']
    for minute, ((arbiter, key), choice, reason) in enumerate(zip(arbiters, ('requester', 'worker', 'worker'),
                                                                  reasons), start=2):
        clock.set(T0 + timedelta(minutes=minute))
        assert vote(client, dispute, arbiter, key, choice, reason).status == 201

    page = get_page(client, f'/disputes/{dispute["id"]}')
    votes = page.find('ul', 'votes').find_all('li')
    assert [(li.find('strong').text(), li.find('span', 'vote').text(), li.find('time').text(),
             li.find('span', 'reasoning').text()) for li in votes] == [
        ('judge 0', 'requester', at(2), 'The tests are red.'), ('judge 1', 'worker', at(3), 'It works for me.'),
        ('judge 2', 'worker', at(4), 'All criteria are met.')]
    assert votes[0].text() == f'judge 0 voted for the requester {at(2)}The tests are red.'     # a <br> between
    assert page.find('p', 'facts').text() == f'resolved · opened {at(1)} · 3 of 3 votes'
    assert page.find('p', 'outcome').text() == f'Decided for the worker on {at(4)} by community.'
    descriptions = [p.text() for p in page.find_all('p', 'description')]
    assert descriptions == ['Half of it is missing.', 'Community vote: 2 of 3 arbitrators decided for the worker.']
    assert [p for p in page.find_all('p', 'empty')] == []
    assert [li.text() for li in page.find('ul', 'panel').find_all('li')] == \
        ['judge 0 voted', 'judge 1 voted', 'judge 2 voted']
    about = [p for p in page.find_all('p') if p.text().startswith('About the delivery of')]
    assert about[0].text() == 'About the delivery of worker-agent (its claim is approved).'


def test_dispute_page_decided_by_an_admin_for_the_requester(market, client, clock):
    job = market.job(title='Admin decides')
    claim = market.claim(job)
    deliver(market, job, claim)
    dispute = open_dispute(client, job, claim, market.requester_key)
    page = get_page(client, f'/disputes/{dispute["id"]}')       # no arbitrator: no panel, an admin's turn
    assert page.find('p', 'needs-admin').text() == \
        'Needs an admin: too few arbitrators without a link to the parties were active to draw a panel.'
    assert [p.text() for p in page.find_all('p', 'empty')] == ['No panel was drawn.', 'No vote yet.',
                                                                'Not decided yet.']
    clock.advance(minutes=9)
    assert resolve(client, dispute, 'requester').status == 200
    page = get_page(client, f'/disputes/{dispute["id"]}')
    assert page.find('p', 'outcome').text() == f'Decided for the requester on {at(9)} by admin.'
    assert page.find_all('p', 'description')[1].text() == 'Decided for the requester.'
    assert [p.text() for p in page.find_all('p', 'empty')] == ['No panel was drawn.', 'No vote yet.']
    assert page.find_all('p', 'needs-admin') == []


def test_dispute_page_of_a_dispute_open_too_long(market, client, clock):
    make_arbitrators(client, 3)
    job = market.job(title='Forgotten')
    claim = market.claim(job)
    deliver(market, job, claim)
    dispute = open_dispute(client, job, claim, market.requester_key)
    assert get_page(client, f'/disputes/{dispute["id"]}').find_all('p', 'needs-admin') == []
    clock.advance(hours=168)
    page = get_page(client, f'/disputes/{dispute["id"]}')
    assert page.find('p', 'needs-admin').text() == 'Needs an admin: open for more than 168 hours.'
    assert len(page.find('ul', 'panel').find_all('li')) == 3


def test_arbitrators_page_with_status_accuracy_and_votes(market, client, app):
    arbiters = make_arbitrators(client, 3)
    set_arbitrator(client, arbiters[0][0], trusted=True)
    job = market.job()
    claim = market.claim(job)
    deliver(market, job, claim)
    dispute = open_dispute(client, job, claim, market.requester_key)
    for (arbiter, key), choice in zip(arbiters, ('worker', 'requester', 'worker')):
        assert vote(client, dispute, arbiter, key, choice).status == 201
    assert register_arbitrator(client, ADMIN_KEY, name='idle').status == 201
    benched = register_arbitrator(client, ADMIN_KEY, name='benched').json['arbitrator']
    assert client.patch(f'/api/arbitrators/{benched["id"]}', {'status': 'suspended'}, key=ADMIN_KEY).status == 200
    _, owner_key = make_account(client, 'agent owner')
    clever, _ = make_agent(client, owner_key, name='clever')
    set_reputation(app, clever, 1000)
    as_agent = register_arbitrator(client, owner_key, name='clever arbiter', agentId=clever['id'])
    assert as_agent.status == 201, as_agent

    page = get_page(client, '/arbitrators')
    assert_frame(page, 'Arbitrators')
    assert table_rows(page) == [['arbiter 0', 'active trusted', '100%', '1'], ['arbiter 2', 'active', '100%', '1'],
                                ['arbiter 1', 'active', '0%', '1'], ['idle', 'pending', '—', '0'],
                                ['clever arbiter', 'pending', '—', '0'], ['benched', 'suspended', '—', '0']]
    assert [(a.attrs['href'], a.text()) for a in page.find('tbody').find_all('a')] == \
        [(f'/agents/{clever["id"]}', 'clever arbiter')]


def test_arbitrators_page_accuracy_rounds_to_whole_percents(market, client):
    arbiters = make_arbitrators(client, 3)
    outcomes = []
    for choices in (('worker', 'worker', 'requester'), ('worker', 'requester', 'requester'),
                    ('requester', 'requester', 'worker')):
        job = market.job()
        claim = market.claim(job)
        deliver(market, job, claim)
        dispute = open_dispute(client, job, claim, market.requester_key)
        for (arbiter, key), choice in zip(arbiters, choices):
            answer = vote(client, dispute, arbiter, key, choice)
            assert answer.status == 201, answer
        outcomes.append(answer.json['outcome'])
    assert outcomes == ['worker', 'requester', 'requester']
    rows = {row[0]: row[2:] for row in table_rows(get_page(client, '/arbitrators'))}
    assert rows == {'arbiter 0': ['67%', '3'], 'arbiter 1': ['100%', '3'], 'arbiter 2': ['33%', '3']}


def test_arbitrators_page_without_arbitrators(client):
    page = get_page(client, '/arbitrators')
    assert table_rows(page) == []
    assert page.find('p', 'empty').text() == 'No arbitrator yet.'


# The stylesheet and the pages' rate limit ----------------------------------------

def test_stylesheet_is_served_cached_and_unchanged(client):
    answer = client.get('/static/style.css')
    assert answer.status == 200, answer
    assert answer.headers['Content-Type'] == 'text/css; charset=utf-8'
    assert answer.headers['Cache-Control'] == 'public, max-age=3600'
    assert answer.body == (mp.HERE / 'static' / 'style.css').read_bytes()
    assert b'.timeline' in answer.body and len(answer.body) > 1000


def test_the_site_name_and_the_icon_are_on_every_page(tmp_path):
    settings = mp.Settings(db=str(tmp_path / 'named.db'), rate_limits='off', public_url='http://market.test',
                           site_name='Acme Agents & Co')
    app = wiring.make_app(settings)
    try:
        client = Client(app)
        page = get_page(client, '/')
        assert page.find('title').text() == 'Open jobs · Acme Agents & Co'
        assert page.find('a', 'brand').text() == 'Acme Agents & Co'
        [icon] = [link for link in page.find_all('link') if link.attrs.get('rel') == 'icon']
        assert (icon.attrs['href'], icon.attrs['type']) == ('/static/favicon.svg', 'image/svg+xml')
        answer = client.get('/static/favicon.svg')
        assert (answer.status, answer.headers['Content-Type']) == (200, 'image/svg+xml')
        assert answer.body == (mp.HERE / 'static' / 'favicon.svg').read_bytes() and answer.body.startswith(b'<svg')
    finally:
        app.service.close()


def rate_limited_client(tmp_path, scale=1.0):
    settings = mp.Settings(db=str(tmp_path / f'limited{scale}.db'), rate_limits='on', rate_limit_scale=scale,
                           admin_key=ADMIN_KEY, public_url='http://market.test', allow_private_webhooks=True)
    app = wiring.make_app(settings)
    return app, Client(app)


def test_pages_have_their_own_bucket_of_600_per_hour(tmp_path):
    assert mp.RATE_LIMITS['pages'] == 600
    app, client = rate_limited_client(tmp_path)
    try:
        page = client.get('/')
        assert (header(page, 'X-RateLimit-Limit'), header(page, 'X-RateLimit-Remaining')) == ('600', '599')
        api = client.get('/api/jobs')
        assert (header(api, 'X-RateLimit-Limit'), header(api, 'X-RateLimit-Remaining')) == ('60', '59')
        for path, remaining in (('/agents', '599'), ('/arbitrators', '599'), (f'/jobs/{UNKNOWN_ID}', '599'),
                                ('/?min_pay=abc', '598')):           # each page (route) its own count
            answer = client.get(path)
            assert answer.headers['Content-Type'] == HTML, path
            assert (header(answer, 'X-RateLimit-Limit'), header(answer, 'X-RateLimit-Remaining')) == \
                ('600', remaining), path
        assert header(client.get('/api/agents'), 'X-RateLimit-Remaining') == '59'     # each endpoint its own
        style = client.get('/static/style.css')
        assert style.status == 200
        assert not any(name.lower().startswith('x-ratelimit') for name in style.headers)
    finally:
        app.service.close()


def test_an_exhausted_page_bucket_leaves_the_api_and_the_stylesheet_alone(tmp_path):
    app, client = rate_limited_client(tmp_path, scale=0.01)      # pages 6 an hour, API reads 1 an hour
    try:
        for _ in range(6):
            assert client.get('/').status == 200
        refused = client.get('/')
        assert refused.status == 429, refused
        assert header(refused, 'X-RateLimit-Limit') == '6' and int(header(refused, 'Retry-After')) >= 1
        assert client.get('/api/jobs').status == 200
        assert client.get('/api/jobs').status == 429
        for _ in range(3):
            assert client.get('/static/style.css').status == 200
    finally:
        app.service.close()


# Every page's frame ----------------------------------------------------------

def test_every_page_has_one_h1_its_title_the_viewport_and_the_stylesheet(market, client):
    job = market.job(title='Framed job')
    claim = market.claim(job)
    deliver(market, job, claim)
    dispute = open_dispute(client, job, claim, market.requester_key)
    make_arbitrators(client, 1)
    pages = {'/': 'Open jobs', '/?q=framed': 'Open jobs', '/?category=code&min_pay=5': 'Open jobs',
             f'/jobs/{job["id"]}': 'Framed job', '/agents': 'Agents', f'/agents/{market.agent["id"]}': 'worker-agent',
             f'/disputes/{dispute["id"]}': 'Dispute: Framed job', '/arbitrators': 'Arbitrators'}
    for path, title in pages.items():
        page = get_page(client, path)
        assert_frame(page, title)
        nav = [a.attrs['href'] for a in page.find('header', 'top').find_all('a')]
        assert nav == ['/', '/', '/agents', '/arbitrators', '/api/docs', '/signin', '/signin#signup'], path
    for path, status, title in (('/?min_pay=x', 400, '400 Bad Request'),
                                (f'/jobs/{UNKNOWN_ID}', 404, '404 Not Found'),
                                ('/agents/1', 400, '400 Bad Request'),
                                (f'/disputes/{UNKNOWN_ID}', 404, '404 Not Found')):
        assert_frame(get_page(client, path, status=status), title)


def test_the_api_page_loads_swagger_ui_from_this_server_and_runs_no_inline_script(client):
    page = get_page(client, '/api/docs')
    assert page.find('title').text() == 'API · Job Marketplace'
    assert page.find('h1').text() == 'API'
    assert [link.attrs['href'] for link in page.find_all('link', rel='stylesheet')] == [
        '/static/style.css', '/static/swagger-ui/swagger-ui.css']
    assert [(script.attrs.get('src'), script.text()) for script in page.find_all('script')] == [
        ('/static/swagger-ui/swagger-ui-bundle.js', ''), ('/static/api-docs.js', '')]
    assert page.find('div', id='swagger-ui').children == []
    assert header(page, 'Content-Security-Policy') == mp.PAGE_CSP
    for path, media, start in (('/static/swagger-ui/swagger-ui-bundle.js', 'text/javascript', b'/*! For license'),
                               ('/static/swagger-ui/swagger-ui.css', 'text/css', b'.swagger-ui'),
                               ('/static/api-docs.js', 'text/javascript', b'// The API page')):
        answer = client.get(path)
        assert (answer.status, header(answer, 'Content-Type'), header(answer, 'Cache-Control')) == (
            200, f'{media}; charset=utf-8', 'public, max-age=3600')
        assert answer.body.startswith(start), answer.body[:40]


def test_agents_page_with_null_capability_lists(client):
    """capabilities.categories null (allowed by POST /api/agents and the document) lists no category, not a 500."""
    _, key = make_account(client, 'owner')
    make_agent(client, key, name='nulls', capabilities={'categories': None, 'languages': None})
    page = get_page(client, '/agents')
    assert table_rows(page) == [['1', 'nulls', '0.00', '0', '0%', '']]
