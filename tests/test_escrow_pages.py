"""The requester's Approve button in contract mode (CONTRACT.md 21), in Debian's Chromium driven by Playwright against
the real server on anvil with a JobEscrow deployed.

With a browser wallet (an EIP-1193 provider: here one the test puts in the page, which signs with the payer's key
in Python through an exposed function) the page's own script asks it to sign the delivery's Release and the worker
is paid at once; without one the page says when the worker will be paid, and the approval is scheduled. The "Post a
job" form in contract mode asks for a deposit into the contract (what to deposit, once the API has said it), never
for money sent to the server's own address. Skips without Chromium, as tests/test_pages_browser.py does.
"""

import json

from chain import Account
from conftest import job_body
from test_escrow_api import PAID, delivery, deposit, detail, post_job, requirements, serving
from test_escrow_contract import ARBITER, escrow  # noqa: F401 (escrow: a fixture)
from test_onchain import call, new_requester, one, settle, statuses
from test_pages_browser import DESKTOP, Tab, browser, screenshot  # noqa: F401 (browser: a fixture; skips without Chromium)
from verifier import escrow as contract_calls

# Before any page script: an EIP-1193 provider whose signatures come from the test (window.__sign, exposed), which
# notes each method asked (window.__note).
WALLET = '''
window.ethereum = {request: function (call) {
  window.__note(call.method);
  if (call.method === 'eth_requestAccounts') return Promise.resolve([window.__account]);
  if (call.method === 'eth_signTypedData_v4') return window.__sign(call.params[1]);
  return Promise.reject(new Error('not here: ' + call.method));
}};
'''


def signed_in(browser, server, key, wallet=None):
    """A tab signed in with `key`; with `wallet` (an eth-account Account), a browser wallet that signs with it."""
    tab = Tab(browser, viewport=DESKTOP)
    tab.asked = []
    if wallet is not None:
        tab.context.expose_function('__note', lambda method: tab.asked.append(method))
        tab.context.add_init_script(f'window.__account = {json.dumps(wallet.address)};' + WALLET)
        tab.context.expose_function('__sign', lambda typed: contract_calls.sign_typed_data(wallet.key,
                                                                                           json.loads(typed)))
    tab.open(server, '/signin')
    tab.page.fill('#apiKey', key)
    tab.page.click('form[action="/signin"] button[type="submit"]')
    tab.page.wait_for_url(lambda url: '/signin' not in url)
    return tab


def funded_delivery(server, escrow, anvil, key):
    """A job funded by its payer's deposit, delivered: (job, claim id, the worker's wallet, the payer)."""
    body = job_body()
    payer, made = deposit(escrow, requirements(server, key, body))
    anvil.mine(1)
    answer = post_job(server, key, body, escrowDepositId=made)
    assert answer.status_code == 201, answer.text
    job = answer.json()['job']
    claim_id, wallet = delivery(server, job)
    return job, claim_id, wallet, payer


def test_approve_signs_the_release_with_the_browsers_wallet_or_says_when_the_worker_is_paid(anvil, escrow, browser,
                                                                                            tmp_path):
    with serving(tmp_path / 'm.db', anvil.url, escrow.address, '--sweep-interval', '0.3') as server:
        key = new_requester(server)
        signed_job, signed_claim, signed_wallet, payer = funded_delivery(server, escrow, anvil, key)
        slow_job, slow_claim, slow_wallet, _ = funded_delivery(server, escrow, anvil, key)

        tab = signed_in(browser, server, key, wallet=Account.from_key(payer.key))
        tab.open(server, f'/jobs/{signed_job["id"]}')
        form = tab.page.locator(f'form[data-release="release-{signed_claim}"]')
        assert 'the worker is paid at once' in form.locator('.release-note').text_content()
        with tab.page.expect_navigation():      # the wallet signs, then the form is sent, and back to the job
            form.locator('button.approve').click()
        assert tab.asked == ['eth_requestAccounts', 'eth_signTypedData_v4']
        paid = one(detail(server, signed_job)['payments'], 'release')
        assert (paid['status'], paid['amount'], paid['recipient']) == ('pending', '24.50', signed_wallet)
        settle(anvil, lambda: statuses(server, signed_job['id'])['release'] == 'confirmed')
        assert anvil.balance(signed_wallet) == PAID
        assert tab.errors == []
        tab.close()

        tab = signed_in(browser, server, key)           # no wallet in this browser
        tab.open(server, f'/jobs/{slow_job["id"]}')
        note = tab.page.locator(f'form[data-release="release-{slow_claim}"] .release-note').text_content()
        assert 'the worker is paid 1 hour after you approve, unless the operator\'s guardian cancels' in note
        with tab.page.expect_navigation():
            tab.page.locator(f'form[data-release="release-{slow_claim}"] button.approve').click()
        scheduled = one(detail(server, slow_job)['payments'], 'release')
        assert (scheduled['status'], scheduled['txHash'], anvil.balance(slow_wallet)) == ('scheduled', None, 0)
        assert tab.errors == []
        tab.close()


def test_the_post_form_asks_for_a_deposit_into_the_contract_never_money_sent_to_the_server(anvil, escrow, browser,
                                                                                         tmp_path):
    with serving(tmp_path / 'm.db', anvil.url, escrow.address) as server:
        key = new_requester(server)
        tab = signed_in(browser, server, key)
        page = tab.page
        tab.open(server, '/jobs/new')
        funding = page.locator('#funding')
        assert escrow.address in funding.text_content()
        assert ARBITER.address.lower() not in page.content().lower()        # the server's key: no money goes there
        assert page.locator('#escrowTxHash, #escrowSignature, #pay-to').count() == 0
        page.fill('#title', 'Funded from the contract')
        page.fill('#description', 'Make the tests pass.')
        page.fill('#paymentAmount', '25.00')
        with page.expect_navigation():
            page.click('button:has-text("Post the job")')
        wanted = json.loads(page.locator('#escrow-requirements').text_content())       # the API's 402, shown
        assert (wanted['contract'], wanted['amount']) == (escrow.address, '25000000')
        assert ARBITER.address.lower() not in page.content().lower()
        screenshot(page, 'post-form-contract')
        payer, made = deposit(escrow, wanted)
        anvil.mine(1)
        page.fill('#escrowDepositId', made)
        with page.expect_navigation():
            page.click('button:has-text("Post the job")')
        job_id = page.url.rsplit('/', 1)[1]
        job = call(server, 'GET', f'/api/jobs/{job_id}', None, key).json()['job']
        assert (job['title'], job['status'], job['escrowStatus']) == ('Funded from the contract', 'open', 'locked')
        assert anvil.balance(escrow.address) == 25_000_000     # in the contract, nothing with the server's key
        assert tab.errors == []
        tab.close()
