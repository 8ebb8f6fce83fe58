"""A2A 1.0's HTTP+JSON binding at the base URL (CONTRACT.md section 22): the interface the service card names.

`POST /message:send` with a message whose data part is {"skill": <id>, "input": {...}} runs that skill, which is
an MCP tool with the same input, as the caller's Bearer token (through remote_mcp.py's child, the same code as
/mcp), and answers a task: `completed` with the tool's result as a data artifact, or `failed` with its error; a
message without a known skill is a `failed` task whose message lists the skills, answered and not stored. `GET
/tasks/{id}` gives a task back for 24 hours to the account that made it, which keeps its 100 newest; a task keeps
at most 4 KiB of the caller's message (CONTRACT.md section 25: parts past that cut, with a marker). `POST
/tasks/{id}:cancel` is A2A's "not cancelable" (a task is finished when it is answered); `POST /message:stream`
answers the task as Server-Sent Events; a push notification configuration sent with a message receives the
finished task, delivered as webhooks are (the same address checks). Both message routes have the rate-limit class
`a2a` (120 an hour per key).
The messages are a2a-sdk's protobuf types, read and written with protobuf's JSON mapping; its errors are its own
REST error payloads. Only this module imports a2a.
"""

import json
import logging
import threading
from datetime import timedelta

from a2a.types import a2a_pb2 as a2a
from a2a.utils.error_handlers import build_rest_error_payload
from a2a.utils.errors import InvalidParamsError, InvalidRequestError, TaskNotCancelableError, TaskNotFoundError
from bottle import HTTPResponse, request, response
from google.protobuf import json_format

import remote_mcp
from discovery import SKILLS
from host_guard import webhook_url_problem
from marketplace import Unauthorized, account_for_key, iso, new_id, now, now_iso, read_raw_body, route, service

log = logging.getLogger('marketplace.a2a')
TASK_HOURS = 24
KEPT_TASKS = 100                # an account's newest tasks kept
KEPT_MESSAGE_BYTES = 4096       # of the caller's message in a task, as JSON
MARKER_ROOM = 200               # kept free in it for the marker of a cut
MAX_ID_LENGTH = 128             # a message's messageId and contextId, in characters


def a2a_error(error, status):
    """An A2A error answer in the binding's form (google.rpc.Status with an ErrorInfo reason)."""
    return HTTPResponse(json.dumps(build_rest_error_payload(error)), status,
                        headers={'Content-Type': 'application/json'})


def caller_token():
    """The request's Bearer token, when it is a live key or access token; 401 otherwise."""
    scheme, _, token = request.get_header('Authorization', '').partition(' ')
    token = token.strip()
    if scheme.lower() != 'bearer' or not token:
        raise Unauthorized('A2A needs a token: send Authorization: Bearer <an API key or an OAuth access token>.')
    account = account_for_key(service().db, token)
    if account is None:
        raise Unauthorized('This token is not a live API key or access token of this service.')
    return token, account


def read_message(raw):
    """The SendMessageRequest of a body (protobuf's JSON mapping), or an A2A error answer to raise."""
    try:
        sent = json_format.Parse(raw or b'{}', a2a.SendMessageRequest(), ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, UnicodeDecodeError) as exc:
        raise a2a_error(InvalidRequestError(f'The body is not an A2A SendMessageRequest: {exc}'), 400) from None
    if max(len(sent.message.message_id), len(sent.message.context_id)) > MAX_ID_LENGTH:
        raise a2a_error(InvalidParamsError(f'A messageId or contextId is at most {MAX_ID_LENGTH} characters.'), 400)
    return sent


def json_size(message):
    """The length of a protobuf message in the JSON a task is stored as."""
    return len(json.dumps(json_format.MessageToDict(message)))


def kept_message(message, task):
    """The caller's message as its task keeps it, at most KEPT_MESSAGE_BYTES of JSON: its parts in order while they
    fit, the first that does not cut (a text keeps its beginning) with a marker saying what was left out; its
    metadata, extensions and references only when they fit after the parts."""
    kept = a2a.Message(message_id=message.message_id, role=message.role, task_id=task.id, context_id=task.context_id)
    used = json_size(kept) + len(', "parts": []')
    for index, part in enumerate(message.parts):
        cost = json_size(part) + len(', ')
        if used + cost <= KEPT_MESSAGE_BYTES - MARKER_ROOM:
            kept.parts.append(part)
            used += cost
            continue
        after = len(message.parts) - index - 1
        more = f' and {after} more part{"s" if after != 1 else ""}' if after else ''
        if part.WhichOneof('content') == 'text':
            text, room = part.text, KEPT_MESSAGE_BYTES - MARKER_ROOM - used - len(', {"text": ""}')
            low, high = 0, min(len(text), max(room, 0))
            while low < high:       # the longest beginning whose JSON fits in the room
                middle = (low + high + 1) // 2
                low, high = (middle, high) if len(json.dumps(text[:middle])) - 2 <= room else (low, middle - 1)
            marker = f' [cut: {len(text) - low} more characters{more} not kept]'
            kept.parts.add(text=text[:low] + marker)
        else:
            kept.parts.add(text=f'[cut: a {part.WhichOneof("content") or "empty"} part{more} not kept]')
        return kept
    whole = a2a.Message()
    whole.CopyFrom(kept)
    whole.metadata.CopyFrom(message.metadata)
    whole.extensions.extend(message.extensions)
    whole.reference_task_ids.extend(message.reference_task_ids)
    return whole if json_size(whole) <= KEPT_MESSAGE_BYTES else kept


def skill_of(message):
    """(skill id, input) of the first data part {"skill", "input"} of a message, or (None, None)."""
    for part in message.parts:
        if part.HasField('data'):
            data = json_format.MessageToDict(part.data)
            if isinstance(data, dict) and isinstance(data.get('skill'), str):
                given = data.get('input', {})
                return data['skill'], given if isinstance(given, dict) else None
    return None, None


def agent_message(text, task_id, context_id):
    return a2a.Message(message_id=new_id(), role=a2a.ROLE_AGENT, task_id=task_id, context_id=context_id,
                       parts=[a2a.Part(text=text)])


def run_task(sent, token):
    """Run the message's skill: the finished Task (completed or failed), and whether a skill ran. The task's history
    is the message as it is kept (kept_message); the skill runs with the message as sent."""
    message = sent.message
    task = a2a.Task(id=new_id(), context_id=message.context_id or new_id())
    task.history.append(kept_message(message, task))
    skill, given = skill_of(message)
    task.status.timestamp.FromDatetime(now())
    if skill not in SKILLS or given is None:
        task.status.state = a2a.TASK_STATE_FAILED
        task.status.message.CopyFrom(agent_message(
            'Send a data part {"skill": <id>, "input": {...}} naming one of these skills (the MCP tools, with the '
            'same input): ' + ', '.join(SKILLS) + '.', task.id, task.context_id))
        return task, False
    ok, result = remote_mcp.call_tool(token, skill, given)
    if ok:
        task.status.state = a2a.TASK_STATE_COMPLETED
        artifact = task.artifacts.add(artifact_id=new_id(), name=skill)
        artifact.parts.add().data.struct_value.update(result or {})
    else:
        task.status.state = a2a.TASK_STATE_FAILED
        task.status.message.CopyFrom(agent_message(result, task.id, task.context_id))
    return task, True


def task_json(task):
    return json_format.MessageToDict(task)


def keep(task, account):
    """Store a finished task for its account, in one transaction: those past TASK_HOURS forgotten, and the
    account's beyond its KEPT_TASKS newest."""
    db = service().db
    with db.transaction():
        db.execute('DELETE FROM a2a_tasks WHERE created_at < :old',
                   {'old': iso(now() - timedelta(hours=TASK_HOURS))})
        db.insert('a2a_tasks', {'id': task.id, 'account_id': account['id'], 'task': json.dumps(task_json(task)),
                                'created_at': now_iso()})
        db.execute('''DELETE FROM a2a_tasks WHERE account_id = :account AND rowid NOT IN (
                          SELECT rowid FROM a2a_tasks WHERE account_id = :account
                          ORDER BY created_at DESC, rowid DESC LIMIT :kept)''',
                   {'account': account['id'], 'kept': KEPT_TASKS})


def push(config, task):
    """Deliver the finished task to a push notification configuration's URL, as webhooks are delivered (the same
    client, its address checks), in the background; one attempt, logged."""
    svc = service()
    session = svc.webhooks

    def deliver():
        try:
            headers = {'Content-Type': 'application/json', 'User-Agent': 'marketplace-a2a'}
            if config.token:
                headers['X-A2A-Notification-Token'] = config.token
            answer = session.post(config.url, data=json.dumps({'task': task_json(task)}).encode(), headers=headers,
                                  timeout=10)
            log.info('A2A push of task %s to %s: HTTP %s', task.id, config.url, answer.status_code)
        except Exception as exc:        # an address refused, a receiver down: logged, never raised into a request
            log.warning('A2A push of task %s failed: %s', task.id, type(exc).__name__)
    threading.Thread(target=deliver, daemon=True).start()       # a greenlet under serve (patched)


def answer_message(stream):
    token, account = caller_token()
    sent = read_message(read_raw_body())
    config = sent.configuration.task_push_notification_config
    if config.url:
        problem = webhook_url_problem(config.url, service().settings.allow_private_webhooks,
                                      service().settings.dns_server)
        if problem:
            raise a2a_error(InvalidParamsError(f'The push notification URL {problem}.'), 400)
    task, ran = run_task(sent, token)
    if ran:         # a message that names no known skill is answered, not stored
        keep(task, account)
    if config.url:
        push(config, task)
    if not stream:
        return {'task': task_json(task)}
    response.content_type = 'text/event-stream'
    response.set_header('Cache-Control', 'no-store')
    return f'data: {json.dumps({"task": task_json(task)})}\n\n'.encode()


@route('POST', '/message\\:send', limit='a2a')
def message_send():
    """Run a skill (an MCP tool) as the caller: the finished task."""
    return answer_message(stream=False)


@route('POST', '/message\\:stream', limit='a2a')
def message_stream():
    """Run a skill as the caller: the finished task as one Server-Sent Event."""
    return answer_message(stream=True)


@route('GET', '/tasks/<task_id:re:[^/:]+>')     # not /tasks/{id}:cancel (405 for GET)
def get_task(task_id):
    """A task the caller's account made, for 24 hours."""
    _, account = caller_token()
    row = service().db.row('SELECT * FROM a2a_tasks WHERE id = :id AND account_id = :account AND created_at >= :old',
                           {'id': task_id.lower(), 'account': account['id'],
                            'old': iso(now() - timedelta(hours=TASK_HOURS))})
    if row is None:
        raise a2a_error(TaskNotFoundError(f'No task {task_id} of yours (tasks are kept {TASK_HOURS} hours).'), 404)
    return json.loads(row['task'])


@route('POST', '/tasks/<task_id>\\:cancel', limit='job_action')
def cancel_task(task_id):
    """A task is finished when it is answered: not cancelable (or not found)."""
    get_task(task_id)
    raise a2a_error(TaskNotCancelableError('A task here is finished when its message is answered.'), 400)
