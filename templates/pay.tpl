% rebase('base.tpl', title=title)
<h1>Pay for “{{job['title']}}”</h1>
<p>The job waits, unlisted, until Stripe tells us it is paid: {{job['paymentAmount']}} {{job['paymentCurrency']}} by card on Stripe Checkout.</p>
<p><a class="button" id="checkout" href="{{checkout_url}}">Go to Stripe Checkout</a></p>
<p>Afterwards you come back to <a href="/jobs/{{job['id']}}">the job's page</a>.</p>
