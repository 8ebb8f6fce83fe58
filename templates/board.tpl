% rebase('base.tpl', title=title)
<h1>Open jobs</h1>
<form class="filters" method="get" action="/">
  <label>Search <input type="search" name="q" value="{{q}}" maxlength="500" placeholder="words in the title or description"></label>
  <label>Category <select name="category">
    <option value="">any</option>
% for name in categories:
    <option value="{{name}}"{{!' selected' if name == category else ''}}>{{name}}</option>
% end
  </select></label>
  <label>Minimum pay <input type="number" name="min_pay" min="0" step="0.01" value="{{min_pay}}"></label>
  <button type="submit">Show</button>
</form>
<p class="count"><span id="total">{{total}}</span> open <span id="noun">{{'job' if total == 1 else 'jobs'}}</span>{{' matching "' + q + '"' if q else ''}}{{', showing the newest ' + str(len(jobs)) if total > len(jobs) else ''}}.</p>
<ol id="jobs" class="jobs"{{!' data-stream="' + stream + '"' if stream else ''}}>
% for job in jobs:
% include('job_row.tpl', job=job)
% end
</ol>
% if not jobs:
<p id="empty" class="empty">No open job matches.</p>
% end
% if stream:
<script>
/* New jobs arrive from the live stream (Server-Sent Events) and go on top; everything else works without this. */
(function () {
  var list = document.getElementById('jobs');
  if (!window.EventSource) return;
  function text(tag, className, value) {
    var node = document.createElement(tag);
    node.className = className;
    node.textContent = value;
    return node;
  }
  function when(moment) { return moment.slice(0, 10) + ' ' + moment.slice(11, 16) + ' UTC'; }
  var source = new EventSource(list.getAttribute('data-stream'));
  source.addEventListener('job.new', function (event) {
    var job = JSON.parse(event.data);
    if (list.querySelector('[data-id="' + job.id + '"]')) return;
    var item = document.createElement('li');
    item.className = 'job new';
    item.setAttribute('data-id', job.id);
    var link = text('a', 'title', job.title);
    link.href = '/jobs/' + encodeURIComponent(job.id);
    var meta = text('span', 'meta', '');
    meta.appendChild(text('span', 'category', job.category));
    meta.appendChild(document.createTextNode(' '));
    meta.appendChild(text('span', 'pay', job.paymentAmount + ' ' + job.paymentCurrency));
    meta.appendChild(document.createTextNode(' '));
    var due = text('time', 'deadline', 'due ' + when(job.deadline));
    due.setAttribute('datetime', job.deadline);
    meta.appendChild(due);
    item.appendChild(link);
    item.appendChild(document.createTextNode(' '));
    item.appendChild(meta);
    list.insertBefore(item, list.firstChild);
    var empty = document.getElementById('empty');
    if (empty) empty.parentNode.removeChild(empty);
    var total = document.getElementById('total'), count = Number(total.textContent) + 1;
    total.textContent = String(count);
    document.getElementById('noun').textContent = count === 1 ? 'job' : 'jobs';
  });
})();
</script>
% end
