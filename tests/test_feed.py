"""The job feed: RSS 2.0 and Atom of the newest open jobs, well-formed whatever the titles hold."""

import calendar
from datetime import timedelta
from xml.etree import ElementTree

import feedparser
import pytest

import marketplace as mp
import discovery

from conftest import in_hours

RSS_TYPE = 'application/rss+xml; charset=utf-8'
ATOM_TYPE = 'application/atom+xml; charset=utf-8'
FORMATS = {'rss': '/api/jobs/feed', 'atom': '/api/jobs/feed?format=atom'}
HOSTILE_TITLES = [
    '<script>alert(1)</script>',
    '&amp; "quotes" \'single\' & <b>',
    'Emoji 🚀🔥 and accents: café, 日本語',
    ']]> <![CDATA[ x ]]> <!-- not a comment -->',
]


def header(answer, name):
    found = {key.lower(): value for key, value in answer.headers.items()}
    return found.get(name.lower())


def fetch(client, form='rss'):
    """GET the feed in one format; (answer, feedparser result), asserting it parsed cleanly."""
    answer = client.get(FORMATS[form])
    assert answer.status == 200, answer
    parsed = feedparser.parse(answer.body)
    assert not parsed.bozo, parsed.get('bozo_exception')
    assert parsed.version == {'rss': 'rss20', 'atom': 'atom10'}[form]
    return answer, parsed


def unix(iso_time):
    return mp.parse_time(iso_time).timestamp()


def parsed_unix(struct):
    return calendar.timegm(struct)


# Formats -----------------------------------------------------------------------

def test_rss_is_the_default_with_its_content_type(client, market):
    market.job()
    answer, parsed = fetch(client, 'rss')
    assert header(answer, 'Content-Type') == RSS_TYPE
    assert answer.body.startswith(b"<?xml version='1.0' encoding='utf-8'?>")
    assert ElementTree.fromstring(answer.body).tag == 'rss'


def test_format_rss_is_also_accepted(client, market):
    market.job()
    answer = client.get('/api/jobs/feed?format=rss')
    assert answer.status == 200
    assert header(answer, 'Content-Type') == RSS_TYPE


def test_atom_with_its_content_type(client, market):
    market.job()
    answer, parsed = fetch(client, 'atom')
    assert header(answer, 'Content-Type') == ATOM_TYPE
    assert ElementTree.fromstring(answer.body).tag == '{http://www.w3.org/2005/Atom}feed'


def test_unknown_format_is_a_json_400(client):
    answer = client.get('/api/jobs/feed?format=json')
    assert answer.status == 400
    assert header(answer, 'Content-Type') == 'application/json; charset=utf-8'
    assert answer.json['code'] == 'invalid_parameter'
    assert answer.json['status'] == 400
    assert set(answer.json['fields']) == {'format'}


@pytest.mark.parametrize('form', FORMATS)
def test_empty_feed_parses_and_is_dated_now(client, real_clock, form):
    real_clock.set(mp.parse_time('2026-03-01T12:00:00Z'))
    _, parsed = fetch(client, form)
    assert parsed.entries == []
    assert parsed_unix(parsed.feed.updated_parsed) == unix('2026-03-01T12:00:00Z')


# The channel -------------------------------------------------------------------

def test_rss_channel(client, market):
    job = market.job()
    _, parsed = fetch(client, 'rss')
    feed = parsed.feed
    assert feed.title == 'Job Marketplace: open jobs'
    assert feed.link == 'http://market.test'
    assert feed.subtitle   # the channel's description
    assert {'rel': 'self', 'type': 'application/rss+xml', 'href': 'http://market.test/api/jobs/feed'} in feed.links
    assert parsed_unix(feed.updated_parsed) == int(unix(job['updatedAt']))


def test_atom_feed_header(client, market):
    job = market.job()
    _, parsed = fetch(client, 'atom')
    feed = parsed.feed
    assert feed.title == 'Job Marketplace: open jobs'
    assert feed.id == 'http://market.test/api/jobs/feed'
    assert feed.subtitle
    assert feed.author == 'Job Marketplace'
    links = {link['rel']: link['href'] for link in feed.links}
    assert links == {'alternate': 'http://market.test', 'self': 'http://market.test/api/jobs/feed?format=atom'}
    assert feed.updated == job['updatedAt']


def test_updated_is_the_newest_job_time(client, market, real_clock):
    real_clock.set(mp.parse_time('2026-03-01T12:00:00Z'))
    market.job(deadline=in_hours(48))
    real_clock.advance(minutes=5)
    newest = market.job(deadline=in_hours(48))
    real_clock.advance(minutes=5)
    for form in FORMATS:
        _, parsed = fetch(client, form)
        assert parsed_unix(parsed.feed.updated_parsed) == int(unix(newest['updatedAt']))


# Items -------------------------------------------------------------------------

@pytest.mark.parametrize('form', FORMATS)
def test_entries_link_to_the_job_pages(client, market, form):
    jobs = [market.job(title=f'Job {n}') for n in range(3)]
    _, parsed = fetch(client, form)
    assert [entry.link for entry in parsed.entries] == [job['url'] for job in reversed(jobs)]
    assert parsed.entries[0].link == f'http://market.test/jobs/{jobs[-1]["id"]}'


@pytest.mark.parametrize('form', FORMATS)
def test_entry_fields(client, market, form):
    job = market.job(title='Label the images', category='data', paymentAmount='75.50', paymentCurrency='USD',
                     description='Put a label on each of the 200 images.')
    _, parsed = fetch(client, form)
    [entry] = parsed.entries
    assert entry.title == 'Label the images'
    assert entry.id == f'urn:uuid:{job["id"]}'
    assert [tag.term for tag in entry.tags] == ['data']
    assert '75.50 USD' in entry.summary
    assert f'deadline {job["deadline"]}' in entry.summary
    assert 'Put a label on each of the 200 images.' in entry.summary
    assert parsed_unix(entry.published_parsed) == int(unix(job['createdAt']))
    assert entry.updated == job['updatedAt']


def test_rss_guid_is_not_a_permalink(client, market):
    job = market.job()
    answer, parsed = fetch(client, 'rss')
    guid = ElementTree.fromstring(answer.body).find('channel/item/guid')
    assert guid.text == f'urn:uuid:{job["id"]}'
    assert guid.get('isPermaLink') == 'false'
    assert parsed.entries[0].guidislink is False


@pytest.mark.parametrize('form', FORMATS)
def test_long_descriptions_are_cut_to_an_excerpt(client, market, form):
    market.job(description='word ' * 2000)
    _, parsed = fetch(client, form)
    summary = parsed.entries[0].summary
    assert len(summary) < 600
    assert '…' in summary


def test_rss_description_markup_is_text_not_html(client, market):
    market.job(description='Use <b>bold</b> & <script>alert(2)</script> freely.')
    _, parsed = fetch(client, 'rss')
    summary = parsed.entries[0].summary
    assert '<b>' not in summary and '<script>' not in summary
    assert '&lt;b&gt;bold&lt;/b&gt; &amp; &lt;script&gt;alert(2)&lt;/script&gt;' in summary


def test_atom_summary_is_plain_text(client, market):
    market.job(description='Use <b>bold</b> & <script>alert(2)</script> freely.')
    _, parsed = fetch(client, 'atom')
    assert parsed.entries[0].summary_detail.type == 'text/plain'
    assert 'Use <b>bold</b> & <script>alert(2)</script> freely.' in parsed.entries[0].summary


# Which jobs --------------------------------------------------------------------

@pytest.mark.parametrize('form', FORMATS)
def test_only_open_jobs(client, market, form):
    open_job = market.job(title='still open')
    market.claim(market.job(title='claimed'))
    cancelled = market.job(title='cancelled')
    assert client.post(f'/api/jobs/{cancelled["id"]}/cancel', key=market.requester_key).status == 200
    job, claim = market.delivered_job(title='approved')
    assert market.verify(job, claim, True).status == 200
    _, parsed = fetch(client, form)
    assert [entry.link for entry in parsed.entries] == [open_job['url']]


def test_open_jobs_past_their_deadline_are_left_out_before_the_sweep(client, market, real_clock):
    market.job(title='due soon', deadline=in_hours(1))
    later = market.job(title='due later', deadline=in_hours(48))
    real_clock.advance(hours=2)
    _, parsed = fetch(client, 'rss')
    assert [entry.title for entry in parsed.entries] == ['due later']
    assert parsed.entries[0].link == later['url']


@pytest.mark.parametrize('form', FORMATS)
def test_the_50_newest_newest_first(client, market, real_clock, form):
    real_clock.set(mp.now())
    jobs = []
    for n in range(55):
        jobs.append(market.job(title=f'Job {n}', deadline=mp.iso(mp.now() + timedelta(days=2))))
        real_clock.advance(seconds=1)
    _, parsed = fetch(client, form)
    assert len(parsed.entries) == 50
    assert [entry.title for entry in parsed.entries] == [f'Job {n}' for n in range(54, 4, -1)]
    assert [entry.link for entry in parsed.entries] == [job['url'] for job in reversed(jobs[5:])]


# Hostile titles ----------------------------------------------------------------

@pytest.mark.parametrize('form', FORMATS)
@pytest.mark.parametrize('title', HOSTILE_TITLES)
def test_hostile_titles_stay_well_formed_and_round_trip(client, market, form, title):
    market.job(title=title, description=title)
    answer, parsed = fetch(client, form)
    ElementTree.fromstring(answer.body)
    assert parsed.entries[0].title == title
    assert b'<script>' not in answer.body


@pytest.mark.parametrize('form', FORMATS)
def test_control_characters_are_stripped(client, market, form):
    job = market.job(title='bell\x01 and\x08 escape\x1b end', description='nul-ish\x02 \x0b text')
    answer, parsed = fetch(client, form)
    ElementTree.fromstring(answer.body)
    assert parsed.entries[0].title == 'bell and escape end'
    assert client.get(f'/api/jobs/{job["id"]}').json['job']['title'] == 'bell\x01 and\x08 escape\x1b end'


def test_xml_text_keeps_what_xml_allows():
    assert discovery.xml_text('tab\tnl\ncr\r ok é 🚀 \ufffd') == 'tab\tnl\ncr\r ok é 🚀 \ufffd'
    assert discovery.xml_text('a\x00b\x1fc\ufffed\uffffe\ud800f') == 'abcdef'
