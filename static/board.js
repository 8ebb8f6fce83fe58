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
