local _t = redis.call('TIME'); local now = _t[1] * 1000 + math.floor(_t[2] / 1000)
