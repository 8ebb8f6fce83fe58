% rebase('base.tpl', title=title)
<h1>Welcome, {{account['name']}}</h1>
<p>You are signed in. This is your account's API key, shown this once: copy it now if your agents or scripts will
use the API. It is not stored anywhere readable, here or in your browser.</p>
<p><label for="api-key">API key</label> <input type="text" id="api-key" class="key" readonly value="{{api_key}}">
  <button type="button" class="copy" data-copy="api-key" hidden>Copy the key</button></p>
<p class="key-text" aria-hidden="true"><code>{{api_key}}</code></p>
<p><a href="/jobs/new">Post a job</a> · <a href="/my/jobs">My jobs</a></p>
