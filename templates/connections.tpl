% rebase('base.tpl', title=title, form_page=True)
<h1>My connections</h1>
<p>MCP hosts you approved (OAuth). Each acts as your account until you disconnect it, or revoke the API key you
signed in with when you approved it.</p>
% if not grants:
<p class="empty">No MCP host is connected.</p>
% end
% for grant in grants:
<article class="claim connection">
  <p><strong>{{grant['name']}}</strong>, approved <time datetime="{{grant['created_at']}}">{{when(grant['created_at'])}}</time>
% if grant['used_at']:
    , last token <time datetime="{{grant['used_at']}}">{{when(grant['used_at'])}}</time>
% end
  </p>
  <form class="form inline" method="post" action="/my/connections/{{grant['id']}}/revoke">
    <input type="hidden" name="csrf" value="{{csrf()}}">
    <button type="submit" class="reject">Disconnect</button>
  </form>
</article>
% end
