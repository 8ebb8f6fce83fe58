% rebase('base.tpl', title=title)
<h1>Arbitrators</h1>
<table class="leaderboard">
  <thead><tr><th>Arbitrator</th><th>Status</th><th>Accuracy</th><th>Votes</th></tr></thead>
  <tbody>
% for arbitrator in arbitrators:
    <tr><td>{{!'<a href="/agents/' + arbitrator['agentId'] + '">' if arbitrator['agentId'] else ''}}{{arbitrator['name']}}{{!'</a>' if arbitrator['agentId'] else ''}}</td><td><span class="status status-{{arbitrator['status']}}">{{arbitrator['status']}}</span>{{!' <span class="tag">trusted</span>' if arbitrator['trusted'] else ''}}</td><td>{{'—' if arbitrator['accuracy'] is None else '{:.0%}'.format(arbitrator['accuracy'])}}</td><td>{{arbitrator['votesCast']}}</td></tr>
% end
  </tbody>
</table>
% if not arbitrators:
<p class="empty">No arbitrator yet.</p>
% end
