% rebase('base.tpl', title=title)
<h1>Post a job</h1>
% if error:
<p class="error" id="form-error" role="alert" tabindex="-1">{{error.message}}</p>
% end
<form class="form" method="post" action="/jobs/new" novalidate>
  <input type="hidden" name="csrf" value="{{csrf()}}">
  <input type="hidden" name="idempotencyKey" value="{{form_key()}}">
  <label for="title">Title</label>
  <input type="text" id="title" name="title" maxlength="200" required value="{{val('title')}}"{{!invalid('title')}}>
% if 'title' in fields:
  <p class="field-error" id="title-error">Title {{fields['title']}}</p>
% end
  <label for="description">What is asked</label>
  <textarea id="description" name="description" rows="6" required{{!invalid('description')}}>{{val('description')}}</textarea>
% if 'description' in fields:
  <p class="field-error" id="description-error">Description {{fields['description']}}</p>
% end
  <label for="category">Category</label>
  <select id="category" name="category"{{!invalid('category')}}>
% for name in categories:
    <option value="{{name}}"{{!' selected' if name == val('category') else ''}}>{{name}}</option>
% end
  </select>
% if 'category' in fields:
  <p class="field-error" id="category-error">Category {{fields['category']}}</p>
% end
  <div class="pair">
    <div>
      <label for="paymentAmount">Pay</label>
      <input type="text" id="paymentAmount" name="paymentAmount" inputmode="decimal" placeholder="25.00" required value="{{val('paymentAmount')}}"{{!invalid('paymentAmount')}}>
% if 'paymentAmount' in fields:
      <p class="field-error" id="paymentAmount-error">Pay {{fields['paymentAmount']}}</p>
% end
    </div>
    <div>
      <label for="paymentCurrency">Currency</label>
      <select id="paymentCurrency" name="paymentCurrency"{{!invalid('paymentCurrency')}}>
% for name in currencies:
        <option value="{{name}}"{{!' selected' if name == val('paymentCurrency') else ''}}>{{name}} ({{'by card, Stripe Checkout' if rails[name] == 'stripe' else 'simulated' if rails[name] == 'simulated' else 'on chain'}})</option>
% end
      </select>
% if 'paymentCurrency' in fields or 'paymentRail' in fields:
      <p class="field-error" id="paymentCurrency-error">Currency {{fields.get('paymentCurrency') or fields.get('paymentRail')}}</p>
% end
    </div>
  </div>
  <ul class="rails">
% for name in currencies:
% if rails[name] == 'simulated':
    <li>{{name}} is simulated here: no real money moves; the job opens at once with its escrow recorded in the ledger.</li>
% elif rails[name] == 'stripe':
    <li>{{name}} is paid by card: you go to Stripe Checkout, and the job opens once Stripe confirms the payment (pending until paid).</li>
% elif rails[name] == 'contract':
    <li>{{name}} is real USDC on chain, held by the JobEscrow contract: you deposit it into the contract from your wallet, and it leaves only to the worker you approve or back to you.</li>
% else:
    <li>{{name}} is real USDC on chain: send it to the escrow address, sign what is shown below, then post with the transaction's hash and the signature.</li>
% end
% end
  </ul>
  <label for="deadline">Deadline (UTC)</label>
  <input type="datetime-local" id="deadline" name="deadline" required value="{{val('deadline')}}"{{!invalid('deadline')}}>
% if 'deadline' in fields:
  <p class="field-error" id="deadline-error">Deadline {{fields['deadline']}}</p>
% end
  <details class="options"{{!' open' if any(name in fields for name in ('maxWorkers', 'competitionMode', 'verificationWindowHours', 'claimTimeoutHours', 'minReputation', 'requirements', 'acceptanceCriteria')) else ''}}>
    <summary>More options: several workers, how they compete, review time, requirements</summary>
    <label for="maxWorkers">Workers</label>
    <input type="number" id="maxWorkers" name="maxWorkers" min="1" max="100" value="{{val('maxWorkers')}}"{{!invalid('maxWorkers')}}>
% if 'maxWorkers' in fields:
    <p class="field-error" id="maxWorkers-error">Workers {{fields['maxWorkers']}}</p>
% end
    <label for="competitionMode">Competition</label>
    <select id="competitionMode" name="competitionMode"{{!invalid('competitionMode')}}>
% for name in modes:
      <option value="{{name}}"{{!' selected' if name == val('competitionMode') else ''}}>{{name}}</option>
% end
    </select>
    <ul class="hint" id="competitionMode-hint">
      <li><strong>first-wins</strong>: the first delivery you approve is paid the whole price; the other claims end.</li>
      <li><strong>best-wins</strong>: several workers deliver, you approve the one you like best, and only it is paid.</li>
      <li><strong>all-paid</strong>: every delivery you approve is paid its share, the price divided by the workers.</li>
    </ul>
% if 'competitionMode' in fields:
    <p class="field-error" id="competitionMode-error">Competition {{fields['competitionMode']}}</p>
% end
    <label for="verificationWindowHours">Hours to review a delivery</label>
    <input type="number" id="verificationWindowHours" name="verificationWindowHours" min="1" max="720" value="{{val('verificationWindowHours')}}"{{!invalid('verificationWindowHours')}}>
% if 'verificationWindowHours' in fields:
    <p class="field-error" id="verificationWindowHours-error">Hours to review {{fields['verificationWindowHours']}}</p>
% end
    <label for="claimTimeoutHours">Hours a claim may wait for its delivery</label>
    <input type="number" id="claimTimeoutHours" name="claimTimeoutHours" min="1" max="720" value="{{val('claimTimeoutHours')}}"{{!invalid('claimTimeoutHours')}}>
% if 'claimTimeoutHours' in fields:
    <p class="field-error" id="claimTimeoutHours-error">Claim hours {{fields['claimTimeoutHours']}}</p>
% end
    <label for="minReputation">Least reputation of a worker</label>
    <input type="text" id="minReputation" name="minReputation" inputmode="decimal" value="{{val('minReputation')}}"{{!invalid('minReputation')}}>
% if 'minReputation' in fields:
    <p class="field-error" id="minReputation-error">Least reputation {{fields['minReputation']}}</p>
% end
    <label for="requirements">Requirements (a JSON object, e.g. {"language": "python"})</label>
    <textarea id="requirements" name="requirements" rows="3"{{!invalid('requirements')}}>{{val('requirements')}}</textarea>
% if 'requirements' in fields:
    <p class="field-error" id="requirements-error">Requirements {{fields['requirements']}}</p>
% end
    <label for="acceptanceCriteria">Acceptance criteria (one per line)</label>
    <textarea id="acceptanceCriteria" name="acceptanceCriteria" rows="3"{{!invalid('acceptanceCriteria')}}>{{val('acceptanceCriteria')}}</textarea>
% if 'acceptanceCriteria' in fields:
    <p class="field-error" id="acceptanceCriteria-error">Acceptance criteria {{fields['acceptanceCriteria']}}</p>
% end
  </details>
% if funding and funding.get('contract'):
  <fieldset class="funding" id="funding">
    <legend>Funding from the JobEscrow contract (USDC)</legend>
% if funding['requirements']:
    <p>Deposit this into the JobEscrow contract <span class="tx" id="escrow-contract">{{funding['contract']}}</span> from your wallet: approve the contract for <code>amount</code> of the token <span class="tx">{{funding['asset']}}</span>, call <code>deposit(account, amount, refundAfter, salt)</code> with a <code>refundAfter</code> no earlier than <code>minRefundAfter</code> and a salt of your own, then paste the deposit's id (<code>depositId(your wallet, account, refundAfter, salt)</code>) below and post again. Send nothing to any other address.</p>
    <pre class="typed-data" id="escrow-requirements">{{funding['requirements']}}</pre>
% else:
    <p>This job's {{funding['amount'] or 'pay'}} USDC is deposited by you into the JobEscrow contract <span class="tx" id="escrow-contract">{{funding['contract']}}</span>, never sent to this server. Post the form once without a deposit id: the answer shows exactly what to deposit (the amount, your account's hash, the earliest refund date).</p>
% end
    <label for="escrowDepositId">Deposit id</label>
    <input type="text" id="escrowDepositId" name="escrowDepositId" class="tx" value="{{val('escrowDepositId')}}"{{!invalid('escrowDepositId')}}>
% if 'escrowDepositId' in fields:
    <p class="field-error" id="escrowDepositId-error">Deposit id {{fields['escrowDepositId']}}</p>
% end
  </fieldset>
% elif funding:
  <fieldset class="funding" id="funding">
    <legend>Funding on chain (USDC)</legend>
    <p>Send {{funding['amount'] or 'the pay'}} USDC (token <span class="tx">{{funding['asset']}}</span>) to the escrow address <span class="tx" id="pay-to">{{funding['payTo']}}</span>, then sign this with the wallet that sent it (EIP-712; the message's txHash is your transfer's hash):</p>
    <pre class="typed-data" id="funding-typed-data">{{funding['typedData']}}</pre>
    <label for="escrowTxHash">Transfer's transaction hash</label>
    <input type="text" id="escrowTxHash" name="escrowTxHash" class="tx" value="{{val('escrowTxHash')}}"{{!invalid('escrowTxHash')}}>
% if 'escrowTxHash' in fields:
    <p class="field-error" id="escrowTxHash-error">Transaction hash {{fields['escrowTxHash']}}</p>
% end
    <label for="escrowSignature">Signature</label>
    <input type="text" id="escrowSignature" name="escrowSignature" class="tx" value="{{val('escrowSignature')}}"{{!invalid('escrowSignature')}}>
    <button type="button" id="wallet-sign" hidden>Sign with my wallet</button>
  </fieldset>
% end
  <button type="submit">Post the job</button>
</form>
