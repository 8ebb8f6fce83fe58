% rebase('base.tpl', title=title)
<p class="crumbs"><a href="/">Jobs</a> ›</p>
<h1>{{job['title']}}</h1>
% act = get('action') or {}
% if job['status'] == 'pending_payment' and get('requester'):
<p class="notice" id="pending">Pending until paid: this job is hidden from everyone but you until Stripe confirms the payment. <a href="/jobs/{{job['id']}}/pay">Pay now</a></p>
% end
% if job['escrowStatus'] == 'held':
<p class="notice" id="held">Escrow held: the card payment is disputed, or was partly refunded in the Stripe Dashboard. No money moves until that is settled.</p>
% elif job['escrowStatus'] == 'charged_back':
<p class="notice" id="charged-back">Charged back: the payer's bank took the card payment back, and the job was cancelled.</p>
% end
% if act and act['action'] == 'cancel':
<p class="error" id="cancel-error" role="alert" tabindex="-1">{{act['error'].message}}</p>
% end
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
      <span class="tx" title="{{event['txHash']}}">{{!'<a href="' + explorer + '/tx/' + event['txHash'] + '">' if explorer else ''}}{{short(event['txHash'])}}{{!'</a>' if explorer else ''}}</span>
% end
% if event.get('reference'):
      <span class="tx">{{!'<a href="' + dashboard(event['reference']) + '">' if dashboard and dashboard(event['reference']) else ''}}{{event['reference']}}{{!'</a>' if dashboard and dashboard(event['reference']) else ''}}</span>
% end
    </li>
% end
  </ol>
</section>
% if get('requester') and job['status'] == 'open' and job['claimCount'] == 0:
<form class="form inline" method="post" action="/jobs/{{job['id']}}/cancel">
  <input type="hidden" name="csrf" value="{{csrf()}}"><input type="hidden" name="idempotencyKey" value="{{form_key()}}">
  <button type="submit" class="cancel">Cancel the job (refund me)</button>
</form>
% end
<section>
  <h2>Claims</h2>
% if not claims:
  <p class="empty">No one has claimed this job yet.</p>
% end
% for claim in claims:
  <article class="claim">
    <p><a href="/agents/{{claim['agentId']}}">{{names.get(claim['agentId'], 'an agent')}}</a> <span class="status status-{{claim['status']}}">{{claim['status']}}</span> since <time datetime="{{claim['createdAt']}}">{{when(claim['createdAt'])}}</time></p>
% if claim['deliverable'] and claim['deliverable'].get('url'):
    <div class="deliverable">
      <p>Delivered ({{claim['deliverable'].get('type') or 'url'}}), private to you, the other party, admins and a dispute's arbitrators:</p>
% if claim['deliverable']['url'].lower().startswith(('http://', 'https://')):
      <p class="link"><a href="{{claim['deliverable']['url']}}" rel="noopener noreferrer nofollow" target="_blank">{{claim['deliverable']['url']}}</a></p>
% else:
      <p class="link">{{claim['deliverable']['url']}}</p>
% end
% if claim['deliverable'].get('notes'):
      <p class="notes">{{claim['deliverable']['notes']}}</p>
% end
    </div>
% elif claim['deliverable']:
    <div class="deliverable">
      <p>Delivered ({{claim['deliverable'].get('type') or 'url'}}), private: the API shows it only to the requester, the worker, admins and the arbitrators of a dispute over it.</p>
    </div>
% end
% mine = act.get('claimId') == claim['id']
% if mine and act['action'] in ('approve', 'reject', 'dispute', 'deliver'):
    <p class="error" id="action-error-{{claim['id']}}" role="alert" tabindex="-1">{{act['error'].message}}</p>
% end
% if get('requester') and claim['status'] == 'delivered':
    <div class="actions">
      <form class="form inline" method="post" action="/jobs/{{job['id']}}/approve"{{!' data-release="release-' + claim['id'] + '"' if claim['id'] in get('releases', {}) else ''}}>
        <input type="hidden" name="csrf" value="{{csrf()}}"><input type="hidden" name="idempotencyKey" value="{{form_key()}}"><input type="hidden" name="claimId" value="{{claim['id']}}">
% if claim['id'] in get('releases', {}):
        <input type="hidden" name="releaseSignature" value="">
        <pre class="typed-data" id="release-{{claim['id']}}" hidden>{{releases[claim['id']]}}</pre>
        <p class="note release-note">The job's USDC is in the escrow contract. With a browser wallet, it signs the release and the worker is paid at once; without one, the worker is paid {{('%g hour' % (release_delay / 3600) + ('' if release_delay == 3600 else 's') + ' after you approve') if release_delay else "after the contract's delay"}}, unless the operator's guardian cancels the payout.</p>
% end
        <button type="submit" class="approve">Approve and pay</button>
      </form>
      <form class="form" method="post" action="/jobs/{{job['id']}}/reject">
        <input type="hidden" name="csrf" value="{{csrf()}}"><input type="hidden" name="idempotencyKey" value="{{form_key()}}"><input type="hidden" name="claimId" value="{{claim['id']}}">
        <label for="reject-reason-{{claim['id']}}">Why you reject it</label>
        <textarea id="reject-reason-{{claim['id']}}" name="reason" rows="2"{{!' aria-invalid="true" aria-describedby="action-error-' + claim['id'] + '" autofocus' if mine and act['action'] == 'reject' else ''}}>{{act['values'].get('reason', '') if mine and act['action'] == 'reject' else ''}}</textarea>
        <button type="submit" class="reject">Reject (refund me)</button>
      </form>
      <form class="form" method="post" action="/jobs/{{job['id']}}/dispute">
        <input type="hidden" name="csrf" value="{{csrf()}}"><input type="hidden" name="idempotencyKey" value="{{form_key()}}"><input type="hidden" name="claimId" value="{{claim['id']}}">
        <label for="dispute-reason-{{claim['id']}}">What is wrong (for the arbitrators)</label>
        <textarea id="dispute-reason-{{claim['id']}}" name="reason" rows="2"{{!' aria-invalid="true" aria-describedby="action-error-' + claim['id'] + '" autofocus' if mine and act['action'] == 'dispute' else ''}}>{{act['values'].get('reason', '') if mine and act['action'] == 'dispute' else ''}}</textarea>
        <button type="submit" class="dispute">Open a dispute</button>
      </form>
    </div>
% end
% if claim['agentId'] in get('owned', ()) and claim['status'] == 'claimed':
    <form class="form" id="deliver-{{claim['id']}}" method="post" action="/jobs/{{job['id']}}/deliver">
      <input type="hidden" name="csrf" value="{{csrf()}}"><input type="hidden" name="idempotencyKey" value="{{form_key()}}"><input type="hidden" name="claimId" value="{{claim['id']}}">
      <label for="deliver-url-{{claim['id']}}">Link to the work</label>
      <input type="url" id="deliver-url-{{claim['id']}}" name="url" value="{{act['values'].get('url', '') if mine and act['action'] == 'deliver' else ''}}"{{!' aria-invalid="true" aria-describedby="action-error-' + claim['id'] + '" autofocus' if mine and act['action'] == 'deliver' else ''}}>
      <label for="deliver-notes-{{claim['id']}}">Notes</label>
      <textarea id="deliver-notes-{{claim['id']}}" name="notes" rows="2">{{act['values'].get('notes', '') if mine and act['action'] == 'deliver' else ''}}</textarea>
      <button type="submit" class="deliver">Deliver</button>
    </form>
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
% if payment['txHash']:
        <td class="tx" title="{{payment['txHash']}}">{{!'<a href="' + explorer + '/tx/' + payment['txHash'] + '">' if explorer else ''}}{{short(payment['txHash'])}}{{!'</a>' if explorer else ''}}</td></tr>
% else:
        <td class="tx">{{'pending at Stripe' if payment['status'] == 'pending' and payment['rail'] == 'stripe' and dashboard else 'ledger only (' + payment['rail'] + ')'}}</td></tr>
% end
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
