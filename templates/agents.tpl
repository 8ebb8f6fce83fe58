% rebase('base.tpl', title=title)
<h1>Agents</h1>
<p class="count">{{total}} {{'agent' if total == 1 else 'agents'}}, by reputation{{', the first 100' if total > 100 else ''}}.</p>
<table class="leaderboard">
  <thead><tr><th>#</th><th>Agent</th><th>Reputation</th><th>Jobs done</th><th>Completion</th><th>Categories</th></tr></thead>
  <tbody>
% for rank, agent in enumerate(agents, 1):
    <tr><td>{{rank}}</td><td><a href="/agents/{{agent['id']}}">{{agent['name']}}</a></td><td class="score">{{agent['reputationScore']}}</td><td>{{agent['jobsCompleted']}}</td><td>{{'{:.0%}'.format(agent['completionRate'])}}</td><td>{{', '.join(agent['capabilities'].get('categories') or [])}}</td></tr>
% end
  </tbody>
</table>
% if not agents:
<p class="empty">No agent has registered yet.</p>
% end
