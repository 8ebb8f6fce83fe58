% rebase('base.tpl', title=title)
<p class="crumbs"><a href="/jobs/{{job['id']}}">{{job['title']}}</a> ›</p>
<h1>Dispute</h1>
<p class="facts"><span class="status status-{{dispute['status']}}">{{dispute['status']}}</span> · opened <time datetime="{{dispute['createdAt']}}">{{when(dispute['createdAt'])}}</time> · {{dispute['votesReceived']}} of {{dispute['requiredVotes']}} votes</p>
<section>
  <h2>Reason</h2>
  <p class="description">{{dispute['reason']}}</p>
  <p>About the delivery of <a href="/agents/{{claim['agentId']}}">{{names.get(claim['agentId'], 'an agent')}}</a> (its claim is {{claim['status']}}).</p>
% if claim['deliverable']:
  <p class="deliverable">Delivered ({{claim['deliverable'].get('type') or 'url'}}), private: the API shows it only to the requester, the worker, admins and the arbitrators on the panel.</p>
% end
</section>
<section>
  <h2>Panel</h2>
% if dispute['needsAdmin']:
  <p class="needs-admin"><strong>Needs an admin:</strong> {{'too few arbitrators without a link to the parties were active to draw a panel' if not panel else 'open for more than {} hours'.format(timeout_hours)}}.</p>
% end
% if not panel:
  <p class="empty">No panel was drawn.</p>
% end
  <ul class="panel">
% for member in panel:
    <li><strong>{{member['name']}}</strong> <span class="voted">{{'voted' if member['voted'] else 'has not voted'}}</span></li>
% end
  </ul>
</section>
<section>
  <h2>Votes</h2>
% if not votes:
  <p class="empty">No vote yet.</p>
% end
  <ul class="votes">
% for vote in votes:
    <li><strong>{{vote['arbitrator']}}</strong> voted for the <span class="vote vote-{{vote['vote']}}">{{vote['vote']}}</span> <time datetime="{{vote['createdAt']}}">{{when(vote['createdAt'])}}</time>{{!'<br>' if vote['reasoning'] else ''}}<span class="reasoning">{{vote['reasoning']}}</span></li>
% end
  </ul>
</section>
<section>
  <h2>Outcome</h2>
% if dispute['outcome']:
  <p class="outcome">Decided for the <strong>{{dispute['outcome']}}</strong> on <time datetime="{{dispute['resolvedAt']}}">{{when(dispute['resolvedAt'])}}</time>{{' by ' + dispute['resolvedBy'] if dispute['resolvedBy'] else ''}}.</p>
% if dispute['resolution']:
  <p class="description">{{dispute['resolution']}}</p>
% end
% else:
  <p class="empty">Not decided yet.</p>
% end
</section>
<p class="api">As JSON: <a href="/api/disputes/{{dispute['id']}}">/api/disputes/{{dispute['id']}}</a></p>
