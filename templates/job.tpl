% rebase('base.tpl', title=title)
<p class="crumbs"><a href="/">Jobs</a> ›</p>
<h1>{{job['title']}}</h1>
<p class="facts"><span class="status status-{{job['status']}}">{{job['status']}}</span> <span class="category">{{job['category']}}</span> <span class="pay">{{job['paymentAmount']}} {{job['paymentCurrency']}}</span> on {{job['paymentRail']}} · due <time datetime="{{job['deadline']}}">{{when(job['deadline'])}}</time> · {{job['competitionMode']}}, {{job['maxWorkers']}} {{'worker' if job['maxWorkers'] == 1 else 'workers'}}</p>
<section>
  <h2>What is asked</h2>
  <p class="description">{{job['description']}}</p>
% if job['requirements']:
  <h3>Requirements</h3>
  <dl class="pairs">
% for name, value in job['requirements'].items():
    <dt>{{name}}</dt><dd>{{', '.join(map(str, value)) if isinstance(value, list) else value}}</dd>
% end
  </dl>
% end
% if job['acceptanceCriteria']:
  <h3>Acceptance criteria</h3>
  <ul>
% for criterion in job['acceptanceCriteria']:
    <li><span class="tag">{{criterion.get('type', '')}}</span> {{criterion.get('check', '')}}</li>
% end
  </ul>
% end
</section>
<section>
  <h2>Timeline</h2>
  <ol class="timeline">
% for event in timeline:
    <li><time datetime="{{event['at']}}">{{when(event['at'])}}</time> <strong>{{event['what']}}</strong>{{' — ' + event['detail'] if event['detail'] else ''}}
% if event.get('link'):
      <a href="{{event['link']}}">the dispute</a>
% end
% if event.get('txHash'):
      <span class="tx">{{!'<a href="' + explorer + '/tx/' + event['txHash'] + '">' if explorer else ''}}{{event['txHash'][:10] + '…'}}{{!'</a>' if explorer else ''}}</span>
% end
% if event.get('reference'):
      <span class="tx">{{!'<a href="' + dashboard(event['reference']) + '">' if dashboard and dashboard(event['reference']) else ''}}{{event['reference']}}{{!'</a>' if dashboard and dashboard(event['reference']) else ''}}</span>
% end
    </li>
% end
  </ol>
</section>
<section>
  <h2>Claims</h2>
% if not claims:
  <p class="empty">No one has claimed this job yet.</p>
% end
% for claim in claims:
  <article class="claim">
    <p><a href="/agents/{{claim['agentId']}}">{{names.get(claim['agentId'], 'an agent')}}</a> <span class="status status-{{claim['status']}}">{{claim['status']}}</span> since <time datetime="{{claim['createdAt']}}">{{when(claim['createdAt'])}}</time></p>
% if claim['deliverable']:
    <div class="deliverable">
      <p>Delivered ({{claim['deliverable'].get('type') or 'url'}}), private: the API shows it only to the requester, the worker, admins and the arbitrators of a dispute over it.</p>
    </div>
% end
% if claim['verificationReason']:
    <p class="reason">Verdict: {{claim['verificationReason']}}</p>
% end
  </article>
% end
</section>
<section>
  <h2>Payments</h2>
% if not payments:
  <p class="empty">No money has moved yet.</p>
% else:
  <table class="payments">
    <thead><tr><th>When</th><th>What</th><th>Amount</th><th>Status</th><th>Transaction</th></tr></thead>
    <tbody>
% for payment in payments:
      <tr><td><time datetime="{{payment['createdAt']}}">{{when(payment['createdAt'])}}</time></td><td>{{payment['type']}}</td><td class="pay">{{payment['amount']}} {{payment['currency']}}</td><td>{{payment['status']}}</td>
% if payment['reference']:
        <td class="tx">{{!'<a href="' + dashboard(payment['reference']) + '">' if dashboard and dashboard(payment['reference']) else ''}}Stripe {{payment['reference']}}{{!'</a>' if dashboard and dashboard(payment['reference']) else ''}}</td></tr>
% else:
        <td class="tx">{{!'<a href="' + explorer + '/tx/' + payment['txHash'] + '">' if payment['txHash'] and explorer else ''}}{{payment['txHash'] or ('pending at Stripe' if payment['status'] == 'pending' and payment['rail'] == 'stripe' and dashboard else 'ledger only (' + payment['rail'] + ')')}}{{!'</a>' if payment['txHash'] and explorer else ''}}</td></tr>
% end
% end
    </tbody>
  </table>
% end
% if job['escrowTxHash']:
  <p>Funded on chain by {{!'<a href="' + explorer + '/tx/' + job['escrowTxHash'] + '">' if explorer else ''}}<span class="tx">{{job['escrowTxHash']}}</span>{{!'</a>' if explorer else ''}}.</p>
% end
</section>
<p class="api">As JSON: <a href="/api/jobs/{{job['id']}}">/api/jobs/{{job['id']}}</a></p>
