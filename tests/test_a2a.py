"""A2A 1.0's HTTP+JSON binding (CONTRACT.md section 22) through the official `a2a-sdk` client only, against
`marketplace.py serve` as a process: the card's interface answers, a message runs a skill (an MCP tool) as the
caller and answers a task, the task is read back by its account only, a cancel is "not cancelable", the stream
answers the task, a push configuration receives it, and a message without a known skill fails naming the skills.
docs/agents.md's example ("Connect an agent") is run here as written."""

import asyncio
import json
import re
import sqlite3
import subprocess
import sys

import httpx
import pytest
import requests
from a2a.client import ClientConfig, create_client
from a2a.types import a2a_pb2 as a2a
from a2a.utils.constants import TransportProtocol
from a2a.utils.errors import TaskNotCancelableError, TaskNotFoundError
from google.protobuf import json_format

import mcp_server
from conftest import ROOT, LiveServer, Receiver, in_hours
from test_server import Output, stop

TIMEOUT = 30


@pytest.fixture(scope='module')
def server(tmp_path_factory):
    live = LiveServer(tmp_path_factory.mktemp('a2a') / 'm.db', ['--allow-private-webhooks']).start()
    live.out = Output(live)
    yield live
    stop(live)


def new_key(server, name):
    answer = requests.post(f'{server.url}/api/accounts', json={'name': name}, timeout=TIMEOUT)
    assert answer.status_code == 201, answer.text
    return answer.json()['apiKey']


def message(skill, given, **configuration):
    part = a2a.Part()
    part.data.struct_value.update({'skill': skill, 'input': given})
    request = a2a.SendMessageRequest(message=a2a.Message(message_id='m-1', role=a2a.ROLE_USER, parts=[part]))
    for name, value in configuration.items():
        getattr(request.configuration, name).CopyFrom(value)
    return request


async def exchange(server, key, request, streaming=False, then=None):
    """Send one message with the SDK's client (from the card at the base URL); the events, and what `then`
    (an async function of the client and the task) answers."""
    http = httpx.AsyncClient(headers={'Authorization': f'Bearer {key}'}, timeout=TIMEOUT)
    config = ClientConfig(httpx_client=http, streaming=streaming,
                          supported_protocol_bindings=[TransportProtocol.HTTP_JSON])
    client = await create_client(server.url, client_config=config)
    try:
        events = [event async for event in client.send_message(request)]
        after = await then(client, events[-1].task) if then else None
        return events, after
    finally:
        await client.close()
        await http.aclose()


def test_the_sdk_sends_a_message_that_runs_a_skill_and_reads_its_task(server):
    key = new_key(server, 'a2a-requester')

    async def read_back(client, task):
        again = await client.get_task(a2a.GetTaskRequest(id=task.id))
        with pytest.raises(TaskNotCancelableError):
            await client.cancel_task(a2a.CancelTaskRequest(id=task.id))
        return again

    events, again = asyncio.run(exchange(server, key, message('post_job', {
        'title': 'Translate a page', 'description': 'French to English.', 'category': 'content',
        'payment_amount': '8.00', 'deadline': in_hours(12)}), then=read_back))
    [event] = events
    task = event.task
    assert task.status.state == a2a.TASK_STATE_COMPLETED
    job = json_format.MessageToDict(task.artifacts[0].parts[0].data)['job']
    assert (job['title'], job['paymentAmount'], job['status']) == ('Translate a page', '8.00', 'open')
    assert again.id == task.id and again.status.state == a2a.TASK_STATE_COMPLETED
    shown = requests.get(f'{server.url}/api/jobs/{job["id"]}', timeout=TIMEOUT).json()
    assert shown['job']['title'] == 'Translate a page'

    # Another account's client cannot read the task.
    async def someone_else(client, _):
        with pytest.raises(TaskNotFoundError):
            await client.get_task(a2a.GetTaskRequest(id=task.id))
    asyncio.run(exchange(server, new_key(server, 'a2a-stranger'), message('service_health', {}),
                         then=someone_else))


def test_a_failed_skill_an_unknown_skill_and_the_stream(server):
    key = new_key(server, 'a2a-worker')
    [event], _ = asyncio.run(exchange(server, key, message('drain_escrow', {})))
    assert event.task.status.state == a2a.TASK_STATE_FAILED
    words = event.task.status.message.parts[0].text
    assert all(skill in words for skill in mcp_server.TOOL_OPERATIONS)
    unknown = {'job_id': '00000000-0000-4000-8000-000000000000'}
    [event], _ = asyncio.run(exchange(server, key, message('get_job', unknown)))
    assert event.task.status.state == a2a.TASK_STATE_FAILED
    assert '(code: not_found, status: 404)' in event.task.status.message.parts[0].text
    events, _ = asyncio.run(exchange(server, key, message('service_health', {}), streaming=True))
    assert [event.task.status.state for event in events] == [a2a.TASK_STATE_COMPLETED]
    health = json_format.MessageToDict(events[0].task.artifacts[0].parts[0].data)
    assert health['status'] == 'ok'


def test_a_push_configuration_receives_the_finished_task(server):
    receiver = Receiver()
    try:
        key = new_key(server, 'a2a-push')
        config = a2a.TaskPushNotificationConfig(url=receiver.url + '/a2a', token='secret-for-me')
        [event], _ = asyncio.run(exchange(server, key, message('service_health', {},
                                                               task_push_notification_config=config)))
        receiver.wait_for(1)
        body = json.loads(receiver.requests[0]['body'])
        assert body['task']['id'] == event.task.id and body['task']['status']['state'] == 'TASK_STATE_COMPLETED'
        assert receiver.requests[0]['headers']['X-A2A-Notification-Token'] == 'secret-for-me'
    finally:
        receiver.close()


def test_without_a_token_nothing_runs(server):
    answer = requests.post(f'{server.url}/message:send', timeout=TIMEOUT, json=json_format.MessageToDict(
        message('post_job', {'title': 'x'})))
    assert answer.status_code == 401 and answer.json()['code'] == 'unauthorized'
    broken = requests.post(f'{server.url}/message:send', data=b'{"message": 7}', timeout=TIMEOUT,
                           headers={'Authorization': f'Bearer {new_key(server, "a2a-broken")}',
                                    'Content-Type': 'application/json'})
    assert broken.status_code == 400 and broken.json()['error']['details'][0]['reason'] == 'INVALID_REQUEST'


def test_the_readmes_a2a_example_runs_as_written(server, tmp_path):
    readme = (ROOT / 'docs' / 'agents.md').read_text()
    example = re.search(r'<!-- a2a example -->\n```python\n(.*?)```', readme, re.S).group(1)
    script = tmp_path / 'a2a_example.py'
    script.write_text(example)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env={'MARKETPLACE_URL': server.url, 'MARKETPLACE_API_KEY': new_key(server, 'readme')})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[0] == 'TASK_STATE_COMPLETED'


def new_account(server, name):
    """(the account's id, its key)."""
    answer = requests.post(f'{server.url}/api/accounts', json={'name': name}, timeout=TIMEOUT)
    assert answer.status_code == 201, answer.text
    return answer.json()['account']['id'], answer.json()['apiKey']


def send(server, key, request):
    """POST /message:send with a SendMessageRequest in protobuf's JSON mapping: the answered task (as JSON)."""
    answer = requests.post(f'{server.url}/message:send', data=json.dumps(json_format.MessageToDict(request)),
                           headers={'Authorization': f'Bearer {key}', 'Content-Type': 'application/json'},
                           timeout=TIMEOUT)
    assert answer.status_code == 200, answer.text
    return answer.json()['task']


def stored_tasks(server, account_id):
    """The a2a_tasks rows of an account, as the server's database holds them: {task id: the stored JSON}."""
    with sqlite3.connect(f'file:{server.db}?mode=ro', uri=True) as db:
        return dict(db.execute('SELECT id, task FROM a2a_tasks WHERE account_id = ?', (account_id,)).fetchall())


def test_a_task_keeps_at_most_4_kib_of_the_callers_message(server):
    """40 messages of 1 MiB (the body limit) naming a real skill: each runs, and each stored task keeps the skill's
    data part whole and the beginning of the text, cut with a marker, within 4 KiB of message."""
    account_id, key = new_account(server, 'a2a-megabytes')
    request = message('service_health', {})
    request.message.parts.add(text='')
    request.message.parts[1].text = 'w' * (1024 * 1024 - len(json.dumps(json_format.MessageToDict(request))))
    assert len(json.dumps(json_format.MessageToDict(request))) == 1024 * 1024
    ids = [send(server, key, request)['id'] for _ in range(40)]
    stored = stored_tasks(server, account_id)
    assert sorted(stored) == sorted(ids)
    for task_id, raw in stored.items():
        task = json.loads(raw)
        assert task['status']['state'] == 'TASK_STATE_COMPLETED'
        [kept] = task['history']
        assert len(json.dumps(kept)) <= 4096
        data, text = kept['parts']
        assert data == {'data': {'skill': 'service_health', 'input': {}}}
        assert re.fullmatch(r'w+ \[cut: (\d+) more characters not kept\]', text['text'])
        shown = len(text['text']) - len(text['text'].lstrip('w'))
        assert shown + int(re.search(r'cut: (\d+)', text['text']).group(1)) == len(request.message.parts[1].text)
        assert len(raw) < 8192      # the rest: the skill's answer (the health) and the status
        back = requests.get(f'{server.url}/tasks/{task_id}', headers={'Authorization': f'Bearer {key}'},
                            timeout=TIMEOUT)
        assert back.status_code == 200 and back.json() == task


def test_an_account_keeps_its_100_newest_tasks(server):
    account_id, key = new_account(server, 'a2a-many')
    ids = [send(server, key, message('service_health', {}))['id'] for _ in range(104)]
    stored = stored_tasks(server, account_id)
    assert sorted(stored) == sorted(ids[4:])
    headers = {'Authorization': f'Bearer {key}'}
    for task_id, status in ((ids[0], 404), (ids[3], 404), (ids[4], 200), (ids[-1], 200)):
        assert requests.get(f'{server.url}/tasks/{task_id}', headers=headers, timeout=TIMEOUT).status_code == status


def test_a_message_naming_no_skill_is_answered_and_not_stored(server):
    account_id, key = new_account(server, 'a2a-no-skill')
    nothing = a2a.SendMessageRequest(message=a2a.Message(message_id='m-2', role=a2a.ROLE_USER,
                                                         parts=[a2a.Part(text='x' * 500_000)]))
    for request in (nothing, message('drain_escrow', {'all': True})):
        task = send(server, key, request)
        assert task['status']['state'] == 'TASK_STATE_FAILED'
        assert 'service_health' in task['status']['message']['parts'][0]['text']
        assert requests.get(f'{server.url}/tasks/{task["id"]}', headers={'Authorization': f'Bearer {key}'},
                            timeout=TIMEOUT).status_code == 404
    assert stored_tasks(server, account_id) == {}
