% rebase('base.tpl', title=title, refresh=location)
<h1>{{title}}</h1>
<p>{{'You approved the host: it is being sent its code.' if approved else 'You denied the host: it is being told so.'}}
Your browser goes on to <strong>{{redirect_host}}</strong> now; if it does not,
<a id="continue" href="{{location}}">continue to {{redirect_host}}</a>.</p>
% if approved:
<p>The host shows on <a href="/my/connections">My connections</a> once it has exchanged its code for a token.</p>
% end
