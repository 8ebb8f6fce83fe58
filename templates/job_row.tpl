<li class="job" data-id="{{job['id']}}">
  <a class="title" href="/jobs/{{job['id']}}">{{job['title']}}</a>
  <span class="meta">{{!'<span class="status status-' + job['status'] + '">' + job['status'] + '</span> ' if get('show_status') else ''}}<span class="category">{{job['category']}}</span> <span class="pay">{{job['paymentAmount']}} {{job['paymentCurrency']}}</span> <time class="deadline" datetime="{{job['deadline']}}">due {{when(job['deadline'])}}</time></span>
</li>
