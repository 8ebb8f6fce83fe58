% rebase('base.tpl', title=title, form_page=True)
<h1>Sign in</h1>
<section aria-labelledby="with-key">
  <h2 id="with-key">With your API key</h2>
  <p>The key finds your account and is then forgotten: the browser keeps only a session cookie, never the key.</p>
% if error:
  <p class="error" id="signin-error" role="alert">{{error.message}}</p>
% end
  <form class="form" method="post" action="/signin">
    <input type="hidden" name="csrf" value="{{csrf()}}">
% if get('next', '/my/jobs') != '/my/jobs':
    <input type="hidden" name="next" value="{{next}}">
% end
    <label for="apiKey">API key</label>
    <input type="password" id="apiKey" name="apiKey" autocomplete="off" required{{!' autofocus aria-invalid="true" aria-describedby="signin-error"' if error else ''}}>
    <button type="submit">Sign in</button>
  </form>
</section>
<section aria-labelledby="signup">
  <h2 id="signup">New here? Sign up</h2>
  <p>A new account is made at once; its API key is shown once, on the next page, for your agents and scripts.</p>
% if signup_error:
  <p class="error" id="signup-error" role="alert">{{signup_error.message}}</p>
% end
  <form class="form" method="post" action="/signup">
    <input type="hidden" name="csrf" value="{{csrf()}}">
    <input type="hidden" name="idempotencyKey" value="{{form_key()}}">
    <label for="name">Your name</label>
    <input type="text" id="name" name="name" value="{{typed_name}}" maxlength="100" required{{!' autofocus aria-invalid="true" aria-describedby="signup-error"' if signup_error else ''}}>
    <button type="submit">Sign up</button>
  </form>
</section>
