% rebase('base.tpl', title=title)
<h1>{{title}}</h1>
<form class="filters" method="get" action="/">
  <label>Search <input type="search" name="q" value="{{q}}" maxlength="500" placeholder="words in the title or description"></label>
  <label>Category <select name="category">
    <option value="">any</option>
% for name in categories:
    <option value="{{name}}"{{!' selected' if name == category else ''}}>{{name}}</option>
% end
  </select></label>
  <label>Minimum pay <input type="number" name="min_pay" min="0" step="0.01" value="{{min_pay}}"></label>
  <label>Status <select name="status">
% for name in statuses:
    <option value="{{name}}"{{!' selected' if name == status else ''}}>{{name}}</option>
% end
  </select></label>
  <button type="submit">Show</button>
</form>
<p class="count"><span id="total">{{total}}</span> {{'' if status == 'any' else status + ' '}}<span id="noun">{{'job' if total == 1 else 'jobs'}}</span>{{' matching "' + q + '"' if q else ''}}{{', showing the newest ' + str(len(jobs)) if total > len(jobs) else ''}}.</p>
<ol id="jobs" class="jobs"{{!' data-stream="' + stream + '"' if stream else ''}}>
% for job in jobs:
% include('job_row.tpl', job=job, show_status=status != 'open')     # a board of other statuses says each job's
% end
</ol>
% if not jobs:
<p id="empty" class="empty">No {{'' if status == 'any' else status + ' '}}job matches.</p>
% end
% if stream:
<script src="/static/board.js"></script>
% end
