% rebase('base.tpl', title=title)
<h1>{{title}}</h1>
<p class="error">{{error.message}}</p>
<p><a href="/">Back to the open jobs</a></p>
