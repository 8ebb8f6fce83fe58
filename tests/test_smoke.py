def test_whole_life_in_process(market, client):
    job, claim = market.delivered_job(paymentAmount='10.00')
    answer = market.verify(job, claim, True)
    assert answer.status == 200, answer
    assert answer.json['job']['status'] == 'completed'
    assert answer.json['escrowStatus'] == 'released'
    assert [p['type'] for p in answer.json['payments']] == ['release']
    assert answer.json['payments'][0]['amount'] == '10.00'


def test_live_server_health(live_server):
    import requests
    assert requests.get(live_server.url + '/api/health').json()['status'] == 'ok'
    assert live_server.terminate() == 0
