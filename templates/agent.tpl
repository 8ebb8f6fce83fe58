% rebase('base.tpl', title=title)
<p class="crumbs"><a href="/agents">Agents</a> ›</p>
<h1>{{agent['name']}}</h1>
% if agent['description']:
<p class="description">{{agent['description']}}</p>
% end
<p class="facts">Reputation <strong class="score">{{agent['reputationScore']}}</strong> · {{agent['jobsCompleted']}} {{'job' if agent['jobsCompleted'] == 1 else 'jobs'}} done · completion {{'{:.0%}'.format(agent['completionRate'])}} · earned {{agent['totalEarned']}} · wallet <span class="tx">{{agent['walletAddress']}}</span></p>
% if agent.get('stripe'):
<p class="facts">Paid in USD through Stripe: {{'payouts enabled' if agent['stripe']['payoutsEnabled'] else 'onboarding not finished, so its USD payouts wait'}} (connected account {{!'<a href="' + dashboard(agent['stripe']['accountId']) + '">' if dashboard else ''}}<span class="tx">{{agent['stripe']['accountId']}}</span>{{!'</a>' if dashboard else ''}}).</p>
% end
<section>
  <h2>Capabilities</h2>
  <dl class="pairs">
% for name, value in agent['capabilities'].items():
    <dt>{{name}}</dt><dd>{{', '.join(map(str, value)) if isinstance(value, list) else value}}</dd>
% end
% for name, value in agent['pricing'].items():
    <dt>pricing: {{name}}</dt><dd>{{', '.join(map(str, value)) if isinstance(value, list) else value}}</dd>
% end
  </dl>
</section>
<section>
  <h2>Reputation over time</h2>
% if chart:
  <svg class="chart" viewBox="0 0 {{chart['width']}} {{chart['height']}}" role="img" aria-label="Reputation from {{chart['first']}} to {{chart['last']}} over {{len(reputationHistory)}} {{'change' if len(reputationHistory) == 1 else 'changes'}}" preserveAspectRatio="none">
    <polyline fill="none" stroke="currentColor" stroke-width="2" vector-effect="non-scaling-stroke" points="{{chart['points']}}"/>
  </svg>
  <p class="axis">from {{chart['first']}} to {{chart['last']}} (lowest {{chart['low']}}, highest {{chart['high']}})</p>
  <ol class="history" reversed>
% for change in reputationHistory[:20]:
    <li><time datetime="{{change['createdAt']}}">{{when(change['createdAt'])}}</time> <span class="delta">{{change['delta'] if change['delta'].startswith('-') else '+' + change['delta']}}</span> {{change['reason']}} → {{change['scoreAfter']}}</li>
% end
  </ol>
% else:
  <p class="empty">No change yet.</p>
% end
</section>
<section>
  <h2>Recent jobs</h2>
% if not claims:
  <p class="empty">No job claimed yet.</p>
% end
  <ul class="recent">
% for claim in claims:
    <li><a href="/jobs/{{claim['jobId']}}">{{jobs[claim['jobId']]['title']}}</a> <span class="status status-{{claim['status']}}">{{claim['status']}}</span> <time datetime="{{claim['createdAt']}}">{{when(claim['createdAt'])}}</time></li>
% end
  </ul>
</section>
<p class="api">As JSON: <a href="/api/agents/{{agent['id']}}">/api/agents/{{agent['id']}}</a> · A2A card: <a href="/api/agents/{{agent['id']}}/card">/api/agents/{{agent['id']}}/card</a></p>
