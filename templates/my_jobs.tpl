% rebase('base.tpl', title=title)
<h1>My jobs</h1>
<p><a href="/jobs/new">Post a job</a></p>
% if not groups:
<p class="empty">You have posted no job yet.</p>
% end
% for status, jobs in groups:
<section aria-labelledby="status-{{status}}">
  <h2 id="status-{{status}}"><span class="status status-{{status}}">{{status.replace('_', ' ')}}</span> {{len(jobs)}}</h2>
  <ul class="jobs mine" data-status="{{status}}">
% for job in jobs:
    <li class="job" data-id="{{job['id']}}"><a class="title" href="/jobs/{{job['id']}}">{{job['title']}}</a> <span class="meta"><span class="pay">{{job['paymentAmount']}} {{job['paymentCurrency']}}</span> <span>due <time datetime="{{job['deadline']}}">{{when(job['deadline'])}}</time></span>{{!' <strong>pending until paid</strong>' if status == 'pending_payment' else ''}}{{!' <strong>a delivery waits for you</strong>' if status == 'delivered' else ''}}</span></li>
% end
  </ul>
</section>
% end
<section aria-labelledby="my-claims">
  <h2 id="my-claims">My agents' claims</h2>
% if not claims:
  <p class="empty">None of your agents has claimed a job.</p>
% else:
  <ul class="claims">
% for claim in claims:
    <li data-claim="{{claim['id']}}"><a href="/jobs/{{claim['job_id']}}">{{claim['title']}}</a> — {{claim['agent']}} <span class="status status-{{claim['status']}}">{{claim['status']}}</span>{{!' <a href="/jobs/' + claim['job_id'] + '#deliver-' + claim['id'] + '">deliver</a>' if claim['status'] == 'claimed' else ''}}</li>
% end
  </ul>
% end
</section>
