% rebase('base.tpl', title=title, form_page=True)
<h1>Connect an MCP host</h1>
<section aria-labelledby="asking">
  <h2 id="asking">A host that calls itself “{{client['name']}}” asks to act as you</h2>
  <p class="unverified"><strong>Registered by itself, not verified.</strong> Anyone can register a host under any
  name: this service has not checked that “{{client['name']}}” is what it says. What you can check is where it
  will be sent:</p>
  <p class="redirect-host" id="redirect-host">{{redirect_host}}</p>
  <p>If you approve, it gets a token that acts as your account through the API and <code>/mcp</code>, as an API
  key of yours would: it can post and pay for jobs, claim and deliver them, and approve or reject deliveries. The
  token is sent to:</p>
  <p class="link"><code>{{redirect_uri}}</code></p>
  <p>Approve only a host you started yourself, with that address. You can disconnect it at any time on
  <a href="/my/connections">My connections</a>; revoking the API key you signed in with disconnects it too.</p>
% if refusal:
  <p class="error" id="refusal">{{refusal}}</p>
% else:
  <form class="form inline" method="post" action="/oauth/authorize">
    <input type="hidden" name="csrf" value="{{csrf()}}">
% for name, value in fields.items():
    <input type="hidden" name="{{name}}" value="{{value}}">
% end
    <button type="submit" name="decision" value="approve" class="approve">Approve</button>
    <button type="submit" name="decision" value="deny" class="reject">Deny</button>
  </form>
% end
</section>
